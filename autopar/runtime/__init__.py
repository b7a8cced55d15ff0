"""Runtime: the world (process groups, mesh, plan checks), parameters and ZeRO, the bucketed
gradient reducer, pipeline schedules, deterministic init, collective logs, and launching CPU ranks.

    world.py        init_world / build_mesh / check_agreement (timeouts everywhere)
    params.py       ParamStore: tp-local storage, ZeRO row shards, parameters as DTensors
    reducer.py      GradReducer: bucketed, overlapped all-reduce / reduce-scatter over dp
    init.py         counter-based init of any shard; materialize(module_on_meta, seed)
    buffers.py      the module's buffers on this rank's device (meta buffers regenerated)
    failures.py     a peer's failure re-raised with what autopar was doing
    collectives.py  Collective records and the recorder of DTensor's collectives
    pipeline.py     the plan's stages as torch.distributed.pipelining stages under its schedule;
                    tied parameters summed over pp; forward-only passes through the stages
    launch.py       spawn_ranks (N gloo ranks; heartbeats and progress watched, a dead or stuck rank
                    named at once, nothing left behind); ``autopar run`` is ``autopar/cli_run.py``
    forkserver_exit.py  preloaded into spawn_ranks' forkserver: removes the launcher's temp dir
"""
from autopar.runtime.init import materialize
from autopar.runtime.launch import report_progress, spawn_ranks

__all__ = ["materialize", "report_progress", "spawn_ranks"]
