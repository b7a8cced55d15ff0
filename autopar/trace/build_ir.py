"""ExportedProgram -> GraphIR: node kinds, stable keys, block/layer ids, shapes, FLOPs, fingerprint.

Keys (see ``autopar.ir``): ``"<module path, layer index replaced by *>|<target>|<k>"``.

- ops: module path = innermost ``nn_module_stack`` entry (the traced wrapper's prefix removed),
  target = ``"aten.linear.default"`` / ``"getitem"``, k counts equal (path, target) pairs inside one
  layer instance (outside blocks: in the whole graph), in graph order.
- param / buffer: ``"<fully-qualified name, layer index replaced by *>|param|0"`` (``|buffer|0``);
  the name is the placeholder's own (so tied weights get two nodes with two keys, and both carry the
  same canonical ``param_name``); lifted tensor constants: ``"<name>|constant|0"``, kind "buffer",
  ``param_name`` None (their values live in ``GraphIR.exported.constants``).
- user inputs ``"|input|<i>"``; the loss target ``"|target|0"`` (kind "input"); the output
  ``"|output|0"``.
- copy i >= 1 of a repeated block (full traces only) appends ``"@<i>"`` to the key of copy 0, so
  keys are unique in every trace and layer-0 / non-block keys are the same in collapsed and full
  traces. ``base_key`` strips the suffix (what a Plan's node strategy is looked up by).
"""
from __future__ import annotations

import hashlib
import json
import operator
from collections import defaultdict
from typing import Any, Optional

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from autopar.ir import OUTPUT_KEY, GraphIR, NodeInfo, Ref, RepeatedBlock, TensorMeta
from autopar.trace.errors import TraceError, describe_source
from autopar.trace.flops import node_cost
from autopar.trace.repeats import RepeatInfo

WRAPPER_ATTR = "model"   # the user's module inside the traced wrapper (its names get this prefix)


def base_key(key: str) -> str:
    """The key of copy 0 of a block node (strip the ``@<layer>`` suffix of copies >= 1)."""
    return key.split("@", 1)[0]


def strip_wrapper(name: str) -> str:
    if name == WRAPPER_ATTR:
        return ""
    return name[len(WRAPPER_ATTR) + 1:] if name.startswith(WRAPPER_ATTR + ".") else name


def target_name(node: fx.Node) -> str:
    t = node.target
    if node.op != "call_function":
        return "" if node.op in ("placeholder", "output") else f"{node.op}:{t}"
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return str(t)
    return f"{getattr(t, '__module__', '') or ''}.{getattr(t, '__name__', str(t))}".lstrip(".")


def _meta(t: Any) -> Optional[TensorMeta]:
    if isinstance(t, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))
    return None


def _metas(val: Any) -> tuple[TensorMeta, ...]:
    if isinstance(val, torch.Tensor):
        return (_meta(val),)
    if isinstance(val, (list, tuple)):
        return tuple(m for v in val for m in _metas(v))
    return ()


class _Locator:
    """Module path / parameter name of the traced module -> (block, layer_id, starred path)."""

    def __init__(self, repeats: tuple[RepeatInfo, ...]) -> None:
        self.repeats = repeats

    def locate(self, path: str) -> tuple[Optional[str], Optional[int], str]:
        for r in self.repeats:
            head = f"{r.path}." if r.path else ""
            if not path.startswith(head):
                continue
            child, _, rest = path[len(head):].partition(".")
            if child in r.child_names:
                star = f"{head}*" + (f".{rest}" if rest else "")
                return r.path, r.child_names.index(child), star
        return None, None, path


def canonical_names(module: nn.Module) -> dict[int, str]:
    """id(tensor) -> its first fully-qualified name in ``module`` (params, then buffers); tied
    weights get the name ``module.named_parameters()`` reports."""
    names: dict[int, str] = {}
    for n, p in module.named_parameters():
        names.setdefault(id(p), n)
    for n, b in module.named_buffers():
        names.setdefault(id(b), n)
    return names


def _lookup_tensor(root: nn.Module, fqn: str) -> torch.Tensor:
    mod_path, _, attr = fqn.rpartition(".")
    mod = root.get_submodule(mod_path) if mod_path else root
    return getattr(mod, attr)


def build_graph_ir(ep: ExportedProgram, traced_root: nn.Module, canonical: dict[int, str],
                   repeats: tuple[RepeatInfo, ...], collapsed: frozenset[str], *,
                   num_inputs: int, has_target: bool, model_name: str) -> GraphIR:
    """``traced_root`` is the wrapper that was exported (its ``model`` attribute holds the meta
    copy of the user's module or of its collapsed clone); ``canonical`` maps id() of each traced
    parameter/buffer to its name in the ORIGINAL module (``canonical_names``)."""
    locator = _Locator(repeats)
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    keys: dict[str, str] = {}   # FX node name -> key
    used: set[str] = set()
    counters: dict[tuple, int] = defaultdict(int)
    user_input_index = 0
    nodes: list[NodeInfo] = []

    def conv(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return Ref(keys[a.name])
        if isinstance(a, (list, tuple)):
            return tuple(conv(x) for x in a)
        if isinstance(a, torch.dtype):
            return str(a).removeprefix("torch.")
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        return str(a)

    def suffixed(key: str, layer_id: Optional[int]) -> str:
        return f"{key}@{layer_id}" if layer_id else key

    for node in ep.graph.nodes:
        block = layer_id = param_name = None
        if node.op == "placeholder":
            spec = specs[node.name]
            if spec.kind == InputKind.USER_INPUT:
                kind, module_path = "input", ""
                if has_target and user_input_index == num_inputs:
                    key = "|target|0"
                else:
                    key = f"|input|{user_input_index}"
                user_input_index += 1
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                kind = "param" if spec.kind == InputKind.PARAMETER else "buffer"
                own = strip_wrapper(spec.target)
                param_name = canonical.get(id(_lookup_tensor(traced_root, spec.target)), own)
                block, layer_id, star = locator.locate(own)
                module_path = own.rpartition(".")[0]
                key = suffixed(f"{star}|{kind}|0", layer_id)
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                kind, module_path = "buffer", ""
                key = f"{strip_wrapper(spec.target)}|constant|0"
            else:
                raise TraceError(f"could not trace {model_name or 'the model'}: unsupported graph "
                                 f"input {node.name} of kind {spec.kind.name}",
                                 hint="remove script objects / effect tokens from forward()")
            target = ""
            outputs = _metas(node.meta.get("val"))
            flops = bytes_moved = 0
            args: tuple = ()
            kwargs: tuple = ()
        elif node.op == "output":
            kind, key, target, module_path = "output", OUTPUT_KEY, "", ""
            args = (conv(node.args[0]),)
            kwargs = ()
            outputs = tuple(m for a in node.args[0] if isinstance(a, fx.Node)
                            for m in _metas(a.meta.get("val")))
            flops = bytes_moved = 0
        else:
            kind = "op"
            target = target_name(node)
            stack = node.meta.get("nn_module_stack") or {}
            module_path = strip_wrapper(list(stack.values())[-1][0]) if stack else ""
            block, layer_id, star = locator.locate(module_path)
            counter = (block, layer_id, star, target)
            key = suffixed(f"{star}|{target}|{counters[counter]}", layer_id)
            counters[counter] += 1
            args = conv(tuple(node.args))
            kwargs = tuple((k, conv(v)) for k, v in node.kwargs.items())
            outputs = _metas(node.meta.get("val"))
            flops, bytes_moved = node_cost(node)
        if key in used:
            raise AssertionError(f"duplicate node key {key!r} for {node.format_node()}")
        used.add(key)
        keys[node.name] = key
        nodes.append(NodeInfo(
            key=key, name=node.name, kind=kind, target=target, args=args, kwargs=kwargs,
            outputs=outputs, flops=int(flops), bytes_moved=int(bytes_moved),
            module_path=module_path, block=block, layer_id=layer_id, param_name=param_name,
            source=describe_source(node.meta.get("stack_trace")),
        ))

    blocks = tuple(
        RepeatedBlock(path=r.path, count=len(r.child_names),
                      traced=1 if r.path in collapsed else len(r.child_names),
                      param_count=r.param_count)
        for r in repeats
    )
    return _finish(tuple(nodes), blocks, ep, model_name)


def _multiplicity(blocks: dict[str, RepeatedBlock], n: NodeInfo) -> int:
    if n.block is None:
        return 1
    b = blocks[n.block]
    return b.count // b.traced


def _fingerprint(nodes: tuple[NodeInfo, ...], blocks: tuple[RepeatedBlock, ...]) -> str:
    """sha256 over the nodes outside blocks and of block copy 0 (keys, kinds, targets, edges by
    base key, output shapes/dtypes, param names) and the block counts. Literal arguments (devices!)
    and FX names are left out, so a meta trace and a CPU trace, collapsed or full, agree."""
    def edges(a: Any) -> Any:
        if isinstance(a, Ref):
            return ["ref", base_key(a.key), a.index]
        if isinstance(a, tuple):
            return [edges(x) for x in a if isinstance(x, (Ref, tuple))]
        return None

    rows = [
        [n.key, n.kind, n.target, edges(n.args), edges(tuple(v for _, v in n.kwargs)),
         [[list(m.shape), m.dtype] for m in n.outputs], n.param_name]
        for n in nodes if not n.layer_id
    ]
    body = {"nodes": rows, "blocks": [[b.path, b.count, b.param_count] for b in blocks]}
    return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()


def _finish(nodes: tuple[NodeInfo, ...], blocks: tuple[RepeatedBlock, ...],
            ep: ExportedProgram, model_name: str) -> GraphIR:
    by_path = {b.path: b for b in blocks}
    seen: set[str] = set()
    param_count = 0
    for n in nodes:
        if n.kind == "param" and n.param_name not in seen:
            seen.add(n.param_name)
            param_count += n.out.numel * _multiplicity(by_path, n)
    fwd_flops = sum(n.flops * _multiplicity(by_path, n) for n in nodes)
    first_input = next((n for n in nodes if n.key == "|input|0"), None)
    batch = first_input.out.shape[0] if first_input and first_input.out.shape else 0
    return GraphIR(
        nodes=nodes, blocks=blocks, batch_size=batch, param_count=param_count,
        fwd_flops=fwd_flops, fingerprint=_fingerprint(nodes, blocks), model_name=model_name,
        graph_module=ep.graph_module, exported=ep,
    )


def chain_violations(nodes: tuple[NodeInfo, ...], blocks: tuple[RepeatedBlock, ...]) -> list[str]:
    """Paths of blocks whose copies do not run one after another.

    Solving one copy and multiplying assumes layer i's output is layer i+1's input. A container of
    identical modules used side by side (parallel heads whose outputs are concatenated) is not a
    repeated block. Traced copies: some node of copy i+1 must read a node of copy i. One traced
    copy: some tensor it hands to the rest of the graph must have the shape and dtype of a tensor
    it receives (what the next copy would read)."""
    by_key = {n.key: n for n in nodes}
    bad = []
    for b in blocks:
        inside = [n for n in nodes if n.block == b.path]
        if b.traced > 1:
            chained = {n.layer_id for n in inside for r in n.inputs
                       if by_key[r.key].block == b.path
                       and by_key[r.key].layer_id == (n.layer_id or 0) - 1}
            if chained != set(range(1, b.traced)):
                bad.append(b.path)
            continue
        keys = {n.key for n in inside}
        received = {by_key[r.key].outputs[0] for n in inside for r in n.inputs
                    if r.key not in keys and by_key[r.key].kind not in ("param", "buffer")
                    and by_key[r.key].outputs}
        handed = {by_key[r.key].outputs[0] for n in nodes if n.key not in keys for r in n.inputs
                  if r.key in keys and by_key[r.key].outputs}
        if not handed or not handed <= received:
            bad.append(b.path)
    return bad
