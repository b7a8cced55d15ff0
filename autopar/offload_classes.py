"""A plan's ``offload`` value: the tensor classes offload may move off the device, what each
needs beside it, and the canonical ``+``-joined spelling (``runtime/offload.py`` runs them,
``cost/offload.py`` prices them)."""
from __future__ import annotations

# nvme: the optimizer's masters and state in files; nvme_params: ZeRO-3's parameter rows too (read
# from the masters' files at each gather, none in host memory: ZeRO-Infinity's parameter tier);
# nvme_grads: the reduced gradients wait for the step in files, not in host buffers;
# nvme_activations: the offloaded saved tensors wait for the backward in files
OFFLOAD_CLASSES = ("optimizer", "grads", "params", "activations", "nvme", "nvme_params", "nvme_grads",
                   "nvme_activations")
OFFLOAD_CHOICES = ("none",) + OFFLOAD_CLASSES      # single classes (``--force offload=`` joins them with +)
_OFFLOAD_NEEDS = {"grads": ("optimizer",), "params": ("optimizer",), "nvme": ("optimizer",),
                  "nvme_params": ("optimizer", "params", "nvme"), "nvme_grads": ("optimizer", "nvme"),
                  "nvme_activations": ("activations",)}


def parse_offload(text: str) -> tuple[str, ...]:
    """The offloaded tensor classes of an ``offload`` value ("none", or classes of
    ``OFFLOAD_CLASSES`` joined by "+", e.g. "optimizer+activations"), in ``OFFLOAD_CLASSES``
    order. ValueError, saying what to write, for an unknown class or a missing prerequisite."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"offload={text!r}: write 'none' or classes joined by '+' ({', '.join(OFFLOAD_CLASSES)})")
    words = [w.strip().lower() for w in text.split("+")]
    if words == ["none"]:
        return ()
    unknown = [w for w in words if w not in OFFLOAD_CLASSES]
    if unknown:
        raise ValueError(f"offload={text!r}: unknown class {unknown[0]!r}; write 'none' or classes joined "
                         f"by '+' from {', '.join(OFFLOAD_CLASSES)}")
    for w in words:
        need = [n for n in _OFFLOAD_NEEDS.get(w, ()) if n not in words]
        if need:
            raise ValueError(f"offload={text!r}: {w} offload needs {' and '.join(need)} offload too; write "
                             f"{offload_name(set(words) | set(need))}")
    return tuple(c for c in OFFLOAD_CLASSES if c in words)


def offload_name(classes) -> str:
    """The canonical ``offload`` value of a set of classes (inverse of ``parse_offload``)."""
    ordered = tuple(c for c in OFFLOAD_CLASSES if c in set(classes))
    return "+".join(ordered) if ordered else "none"
