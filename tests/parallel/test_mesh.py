"""``ParallelMeshes`` serves axis combinations that include the flattened ``dp_cp`` axis without the slice torch
deprecates (flat ZeRO-3 under TP shards over ``("dp_cp", "tp")``; the slice warned on every such run)."""

from __future__ import annotations


def _dp_cp_tp(shape: tuple[int, int, int]) -> list:
    import warnings

    import torch.distributed as dist

    from lightning_flagscale.config import ParallelConfig
    from lightning_flagscale.parallel.mesh import build_meshes

    dp, cp, tp = shape
    config = ParallelConfig(data_parallel_size=dp, context_parallel_size=cp, tensor_parallel_size=tp).resolve(
        dist.get_world_size()
    )
    meshes = build_meshes(config, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = meshes[("dp_cp", "tp")]
    groups = [dist.get_process_group_ranks(mesh.get_group(d)) for d in ("dp_cp", "tp")]
    return [mesh.mesh.tolist(), mesh.mesh_dim_names, groups, [str(w.message) for w in caught]]


def test_dp_cp_with_tp_is_joined_from_kept_meshes_without_deprecated_slicing(launcher):
    for shape, want in {(2, 1, 2): [[0, 1], [2, 3]], (1, 2, 2): [[0, 1], [2, 3]]}.items():
        for rank, (mesh, names, (dp_cp_group, tp_group), warned) in enumerate(launcher(4, _dp_cp_tp, shape)):
            assert mesh == want and names == ("dp_cp", "tp"), (shape, mesh, names)
            assert dp_cp_group == [r for r in range(4) if r % 2 == rank % 2], (shape, rank, dp_cp_group)
            assert tp_group == [r for r in range(4) if r // 2 == rank // 2], (shape, rank, tp_group)
            assert warned == [], (shape, warned)
