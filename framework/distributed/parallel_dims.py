"""The named device mesh built from the degrees of parallelism (`framework.config.degrees`).

Mesh dims, outermost first: pp, dp_replicate, dp_shard, cp, tp (pp only when parallelism.pp > 1:
a stage's neighbours are a whole data-parallel group away, and only activations cross that link).
Tensor parallel is innermost so its ranks are neighbours (same node) and its many small
collectives stay on the fast links; context parallel next (its all-to-alls run in every block too).
`build_mesh` needs an initialised process group.
"""

from __future__ import annotations

from framework.config.degrees import ParallelDims, resolve_parallel_dims  # noqa: F401  (re-exported)


def build_mesh(dims: ParallelDims, device_type: str):
    """The named mesh (dp_replicate, dp_shard, tp), with cp before tp when context parallel is on;
    submeshes are sliced by name."""
    from framework.distributed.groups import init_mesh

    if dims.cp > 1:
        shape, names = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp), ("dp_replicate", "dp_shard", "cp", "tp")
    else:
        shape, names = (dims.dp_replicate, dims.dp_shard, dims.tp), ("dp_replicate", "dp_shard", "tp")
    if dims.pp > 1:
        shape, names = (dims.pp, *shape), ("pp", *names)
    return init_mesh(device_type, shape, mesh_dim_names=names)
