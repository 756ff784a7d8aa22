"""The named device mesh built from the degrees of parallelism (`framework.config.degrees`).

Mesh dims, outermost first: dp_replicate, dp_shard, tp. Tensor parallel is innermost so its
ranks are neighbours (same node) and its many small collectives stay on the fast links.
`build_mesh` needs an initialised process group.
"""

from __future__ import annotations

from framework.config.degrees import ParallelDims, resolve_parallel_dims  # noqa: F401  (re-exported)


def build_mesh(dims: ParallelDims, device_type: str):
    """The 3-D named mesh (dp_replicate, dp_shard, tp); submeshes are sliced by name."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device_type, (dims.dp_replicate, dims.dp_shard, dims.tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
