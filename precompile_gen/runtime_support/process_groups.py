# Runtime support for collectives: carried after the calls part
# (precompile_gen/runtime_support/calls.py) by every artifact whose graph communicates
# over process groups, from its first "# ---" heading on. The lines above that heading
# are not carried: they import what the rest of the artifact defines, so that ruff and
# pyrefly check this part as a module of its own.
from typing import Any, cast

from precompile_gen.runtime_support.declarations import ARGUMENT_NAMES
from precompile_gen.runtime_support.support import _argument, _fail

# isort: split

# --- Process groups and DistributedDataParallel arguments ---------------------------
# A call on another group, or with DDP options the graph was not built for, would
# reduce wrongly or hang. Section 3 passes PROCESS_GROUPS and DATA_PARALLEL.
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.nn.parallel import DistributedDataParallel


def _group_in_words(record: dict[str, Any]) -> str:
    return (
        f"process group {record['name']!r} ({record['backend']}, global ranks "
        f"{record['ranks']})"
    )


def _process_groups_problem(records: list[dict[str, Any]]) -> str | None:
    """Each group the graph's collectives name (``records``, PROCESS_GROUPS) is this
    process's group of that name, with the backend and global ranks it had at
    capture."""
    if not dist.is_available() or not dist.is_initialized():
        return (
            "this artifact's graph communicates over "
            f"{_group_in_words(records[0])}, and this process has no "
            "torch.distributed process group: call "
            "torch.distributed.init_process_group(...) on every rank before calling "
            "it."
        )
    for record in records:
        try:
            group = _resolve_process_group(record["name"])
        except (ValueError, RuntimeError, KeyError):
            return (
                f"this artifact's graph communicates over {_group_in_words(record)}, "
                "which this process does not have: create the same process groups, "
                "in the same order, as the capturing process did (the graph names "
                "each group as torch.distributed named it there)."
            )
        ranks = dist.get_process_group_ranks(group)
        backend = dist.get_backend(group)
        if ranks != record["ranks"] or backend != record["backend"]:
            return (
                f"this artifact's graph communicates over {_group_in_words(record)}, "
                f"but this process's group {record['name']!r} is {backend} over "
                f"global ranks {ranks}: the graph's collectives were captured for "
                "that world size and rank layout. Precompile again on this group, "
                "or run with the group the artifact was captured on."
            )
    return None


def _data_parallel_problem(
    args: tuple[object, ...], records: list[dict[str, Any]], names: list[str]
) -> str | None:
    """Each DistributedDataParallel argument (``records``, DATA_PARALLEL) as the
    capture had it: on the same group, outside no_sync(), with no communication
    hook."""
    for record in records:
        position = record["position"]
        module = args[position]
        where = _argument(position, names)
        if not isinstance(module, DistributedDataParallel):
            return (
                f"{where} was a DistributedDataParallel module at capture, whose "
                "gradients the graph all-reduces, but this call passes a "
                f"{type(module).__name__}. Pass the DDP-wrapped model, or precompile "
                "again with the model this call passes."
            )
        ddp = cast(Any, module)
        if str(ddp.process_group.group_name) != record["group"]:
            return (
                f"the DistributedDataParallel module at {where} reduces "
                f"over process group {str(ddp.process_group.group_name)!r}, but the "
                f"graph all-reduces its gradients over group {record['group']!r}. "
                "Wrap the model with the group it was captured with, or precompile "
                "again."
            )
        if not ddp.require_backward_grad_sync:
            return (
                f"the DistributedDataParallel module at {where} is inside "
                "a no_sync() context, but the graph all-reduces the gradients on "
                "every call. Call the artifact outside no_sync()."
            )
        if ddp.static_graph:
            return (
                f"the DistributedDataParallel module at {where} was set "
                "to static_graph after capture; the graph does not run DDP's reducer. "
                "Leave static_graph off."
            )
        if ddp._comm_hooks or ddp._get_ddp_logging_data().get("comm_hook"):
            return (
                f"the DistributedDataParallel module at {where} has a "
                "communication hook registered, which the graph's own all-reduce "
                "would bypass. Remove the hook (construct the DDP module without it)."
            )
    return None


def _check_process_groups(records: list[dict[str, Any]]) -> None:
    problem = _process_groups_problem(records)
    if problem is not None:
        _fail(problem)


def _check_data_parallel(
    args: tuple[object, ...], records: list[dict[str, Any]]
) -> None:
    problem = _data_parallel_problem(args, records, ARGUMENT_NAMES)
    if problem is not None:
        _fail(problem)
