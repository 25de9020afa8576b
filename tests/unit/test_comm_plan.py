"""The per-step collective plan and comm_fusion parsing, without MindSpore: bucket rules, the ZeRO
paper's communication volumes (2Φ, 2Φ, 2Φ, 3Φ) and the CPU emulation's extra traffic."""
import pytest

from mindzero.core.comm_plan import buckets, plan_state, step_calls, summarize
from mindzero.core.config import FusionConfig, ZeroConfig, parse_comm_fusion
from mindzero.core.topology import COLLECTIVES, EMULATED, World
from mindzero.core.plan import ParamInfo, PartitionPlan

MIB = 2 ** 20


def test_buckets_are_consecutive_and_bounded():
    assert buckets([4, 4, 4, 4], ["f"] * 4, None) == [(0,), (1,), (2,), (3,)]
    assert buckets([4, 4, 4, 4], ["f"] * 4, 8) == [(0, 1), (2, 3)]
    assert buckets([4, 4, 4, 4], ["f"] * 4, 100) == [(0, 1, 2, 3)]
    assert buckets([4, 20, 4], ["f"] * 3, 8) == [(0,), (1,), (2,)]  # a big tensor travels alone
    assert buckets([4, 4, 4], ["f", "h", "h"], 100) == [(0,), (1, 2)]  # a dtype change closes the bucket
    assert buckets([], [], 8) == []


def test_parse_comm_fusion():
    f = parse_comm_fusion({"allreduce": {"openstate": True, "bucket_size": 5e8},
                           "reduce_scatter": {"bucket_size": 1024}, "allgather": {"openstate": False,
                                                                                   "bucket_size": 5e8}})
    assert f == FusionConfig(allreduce=500000000, reduce_scatter=1024, allgather=None) and f.any
    assert parse_comm_fusion(None) == FusionConfig() and not FusionConfig().any
    for bad, msg in [({"allreduce": 5}, "must be a dict with keys 'openstate'"),
                     ({"allreduce": {"bucket_size": -1}}, "must be a number of bytes >= 1, got -1"),
                     ({"allreduce": {"bucket_size": True}}, "must be a number of bytes >= 1, got True"),
                     ({"allreduce": {"size": 3}}, "must be a dict with keys"),
                     ({"broadcast": {"bucket_size": 3}}, "comm_fusion key 'broadcast' is not one of")]:
        with pytest.raises(ValueError, match=msg):
            parse_comm_fusion(bad)


def _specs(n, shapes=((1000, 1000), (1000,), (37, 11))):
    plan = PartitionPlan.build([ParamInfo(f"p{i}", s) for i, s in enumerate(shapes)], n, 0)
    return list(plan)


def _calls(specs, stage, world, fusion=FusionConfig(), k=1, clip_grad=False, regather=True):
    return step_calls(plan_state(specs, ZeroConfig(stage, k, clip_grad), fusion, regather), world)


def _traffic(stage, n, emulated, fusion=FusionConfig(), k=1, **kw):
    calls = _calls(_specs(n), stage, World.of_sizes(n, n, EMULATED if emulated else COLLECTIVES), fusion, k, **kw)
    return calls, summarize(calls)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_real_collectives_move_the_paper_volumes(n):
    """Ring traffic per rank over Φ fp32 bytes: stage 0 all-reduce 2(n-1)/n Φ; stages 1-2 reduce-scatter +
    all-gather, the same 2(n-1)/n Φ (padding aside); stage 3 with re-gather 3(n-1)/n Φ."""
    phi = 4 * sum(s.numel for s in _specs(n))
    padded = 4 * sum(s.padded_numel for s in _specs(n))
    ring = (n - 1) / n
    flag = 2 * ring * 4  # the overflow flag's all-reduce
    assert _traffic(0, n, False)[1]["total"]["traffic"] == pytest.approx(2 * ring * phi + flag)
    for stage in (1, 2):
        calls, s = _traffic(stage, n, False)
        assert s["reduce_scatter"]["calls"] == 3 and s["all_gather"]["calls"] == 3 and s["all_reduce"]["calls"] == 1
        assert s["total"]["traffic"] == pytest.approx(2 * ring * padded + flag)
    s3 = _traffic(3, n, False)[1]
    assert s3["all_gather"]["calls"] == 6 and s3["reduce_scatter"]["calls"] == 3
    assert s3["total"]["traffic"] == pytest.approx(3 * ring * padded + flag)
    assert _traffic(3, n, False, regather=False)[1]["total"]["traffic"] == pytest.approx(2 * ring * padded + flag)


def test_cpu_emulation_extra_traffic():
    """CPU: each reduce-scatter is an all-reduce of the whole tensor, twice a real one's traffic."""
    n = 4
    real, emu = _traffic(1, n, False)[1], _traffic(1, n, True)[1]
    assert emu["reduce_scatter"]["calls"] == 0 and emu["all_reduce"]["calls"] == 4
    phi = 4 * sum(s.numel for s in _specs(n))
    assert emu["all_reduce"]["traffic"] - 2 * 0.75 * 4 == pytest.approx(2 * 0.75 * phi)
    assert emu["total"]["traffic"] > real["total"]["traffic"]


def test_hybrid_and_accumulation_and_clip():
    specs = _specs(2)
    assert all(s.sharded for s in specs)
    world = World.of_sizes(2, 8, COLLECTIVES)
    s = summarize(_calls(specs, 2, world, k=3, clip_grad=True))
    # stage 2 reduce-scatters every micro-step; hybrid adds a dp all-reduce of each shard
    assert s["reduce_scatter"]["calls"] == 9 and s["all_gather"]["calls"] == 3
    assert s["all_reduce"]["calls"] == 9 + 1 + 1  # dp all-reduces, flag, clip norm
    emu = summarize(_calls(specs, 2, World.of_sizes(2, 8, EMULATED), k=3, clip_grad=True))
    # CPU hybrid: the op-group all-gather is a world all-gather (4 replicas' rows)
    assert emu["all_gather"]["bytes"] == 4 * s["all_gather"]["bytes"]


def test_fusion_cuts_calls_not_bytes():
    plain = _traffic(1, 4, False)[1]
    fused = _traffic(1, 4, False, FusionConfig(allreduce=64 * MIB, reduce_scatter=64 * MIB, allgather=64 * MIB))[1]
    assert fused["reduce_scatter"]["calls"] == 1 and fused["all_gather"]["calls"] == 1
    for op in ("reduce_scatter", "all_gather", "all_reduce"):
        assert fused[op]["bytes"] == plain[op]["bytes"]
    # a 1 MiB bucket: the 4 MB matrix alone, the two small tensors together
    small = _traffic(0, 4, False, FusionConfig(allreduce=MIB))[1]
    assert small["all_reduce"]["calls"] == 2 + 1


def test_owner_gathers_and_broadcasts_are_bucketed_per_dtype_and_bounded():
    """Owner mode's collectives: the gradients gathered to their owners travel in buckets per dtype, and each
    owner's updated parameters in buckets per owner and dtype, of at most OWNER_BUCKET_BYTES of full tensors
    (comm_fusion's allgather size where it sets one): one collective per bucket, never one bucket of everything."""
    from mindzero.core.comm_plan import OWNER_BUCKET_BYTES, step_buckets
    from mindzero.core.optim_plan import FLAT, OWNER, Update
    from mindzero.core.state import BROADCAST_FROM, ParamState

    side = 1448  # an 8 MiB fp32 matrix (a little less)
    infos = [ParamInfo(f"w{i}", (side, side), "float16" if i == 5 else "float32") for i in range(6)]
    infos.append(ParamInfo("bias", (7,)))
    plan = PartitionPlan.build(infos, 2, 0)
    owners = [0, 1, 0, 0, 1, 0, None]
    params = tuple(ParamState(s.name, None, s, s, True, update=Update(FLAT) if o is None else Update(OWNER, o))
                   for s, o in zip(plan, owners))
    policy = ZeroConfig(2, 1, False).policy
    *_, owner_grads, broadcasts = step_buckets(params, policy, FusionConfig())
    # the gradients in optimizer order: two 8 MiB matrices a bucket, w5's (float16) one of its own
    assert [b.positions for b in owner_grads] == [(0, 1), (2, 3), (4,), (5,)]
    assert all(sum(s.numel * s.itemsize for s in b.specs) <= OWNER_BUCKET_BYTES for b in owner_grads)
    assert all(b.kind == BROADCAST_FROM for b in broadcasts)
    # owner 0: w0, w2 (16 MiB: one bucket), w3 (alone), w5 (float16: a bucket of its own); owner 1: w1, w4
    assert [(b.root, b.positions) for b in broadcasts] == [(0, (0, 2)), (0, (3,)), (0, (5,)), (1, (1, 4))]
    assert all(sum(s.numel * s.itemsize for s in b.specs) <= OWNER_BUCKET_BYTES for b in broadcasts)
    *_, owner_grads, broadcasts = step_buckets(params, policy, FusionConfig(allgather=8 * MIB))
    assert [b.positions for b in owner_grads] == [(i,) for i in range(6)]
    assert [(b.root, b.positions) for b in broadcasts] == [(0, (0,)), (0, (2,)), (0, (3,)), (0, (5,)), (1, (1,)),
                                                           (1, (4,))]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_owner_mode_gradients_are_all_reduced_whole_at_stage_1_and_gathered_from_shards_above(stage):
    """Where every rank holds full gradients (stage 1) an owner-mode parameter's gradient is all-reduced whole at the
    boundary, as plain data parallel's, and no gather to its owner follows; from stage 2 its reduced shard is
    all-gathered before the update. Flat parameters are reduce-scattered either way, and the clip norm counts an
    all-reduced gradient by this rank's slice (OWN_SLICE), a shard as it is."""
    from mindzero.core.comm_plan import reduced_whole, step_buckets
    from mindzero.core.optim_plan import FLAT, OWNER, Update
    from mindzero.core.state import ALL_REDUCE, OWN_SLICE, REDUCE_SCATTER, SHARD, ParamState

    plan = PartitionPlan.build([ParamInfo(f"w{i}", (33, 5)) for i in range(3)], 2, 0)
    policy = ZeroConfig(stage, 1, False).policy
    params = tuple(ParamState(s.name, None, s, s, True, update=Update(FLAT) if o is None else Update(OWNER, o))
                   for s, o in zip(plan, [None, 0, 1]))
    for p in params:
        p.all_reduced = reduced_whole(p, policy)
    micro, boundary, gather, owner_grads, broadcasts = step_buckets(params, policy, FusionConfig())
    reductions = {i: b.kind for b in micro + boundary for i in b.positions}
    if stage == 1:
        assert [p.all_reduced for p in params] == [False, True, True]
        assert reductions == {0: REDUCE_SCATTER, 1: ALL_REDUCE, 2: ALL_REDUCE} and owner_grads == ()
        assert [p.norm_kind for p in params] == [SHARD, OWN_SLICE, OWN_SLICE]
    else:
        assert not any(p.all_reduced for p in params)
        assert [b.positions for b in owner_grads] == [(1, 2)]  # one bucket: two small gradients
        assert [p.norm_kind for p in params] == [SHARD] * 3
        if stage == 2:
            assert reductions == {i: REDUCE_SCATTER for i in range(3)}
    assert [(b.root, b.positions) for b in broadcasts] == [(0, (1,)), (1, (2,))]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_update_is_chained_only_where_owner_mode_makes_the_ranks_graphs_differ(stage):
    """``ZeroState.ordered``: the update's collectives wait one for another (a load, an add and an assign of the
    chain per collective, compiled on every rank) only with an owner-mode parameter, whose update graph differs
    between ranks; a step of flat updates alone (the same graph on every rank) gathers its shards unchained."""
    from mindzero.core.comm_plan import step_buckets
    from mindzero.core.optim_plan import FLAT, OWNER, Update
    from mindzero.core.state import ParamState, ZeroState

    plan = PartitionPlan.build([ParamInfo(f"w{i}", (33, 5)) for i in range(3)] + [ParamInfo("bias", (7,))], 2, 0)
    policy = ZeroConfig(stage, 1, False).policy

    def state(owners):
        params = tuple(ParamState(s.name, None, s, s, True, update=Update(FLAT) if o is None else Update(OWNER, o))
                       for s, o in zip(plan, owners))
        micro, boundary, gather, owner_grads, broadcasts = step_buckets(params, policy, FusionConfig())
        return ZeroState(None, None, plan, params, micro=micro, boundary=boundary, gather=gather,
                         owner_grads=owner_grads, broadcasts=broadcasts)

    flat = state([None] * 4)
    assert not flat.ordered
    assert bool(flat.gather) == (stage in (1, 2))  # stages 1-2 gather every updated shard: unchained
    owned = state([0, 1, None, None])
    assert owned.ordered and owned.broadcasts and bool(owned.owner_grads) == (stage > 1)
