"""autotune_parts.config_part: each process compiles a disjoint share of every autotuner's configurations."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl

from rewy_tune import autotune_parts

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32, 64) for w in (1, 2)]  # six


@triton.autotune(configs=CONFIGS, key=["N"])
@triton.jit
def _scaled_copy(x, y, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o, mask=o < N) * 2.0, mask=o < N)


@triton.autotune(configs=CONFIGS[:2], key=["N"])
@triton.jit
def _two_configs(x, N, BLOCK: tl.constexpr):
    pass


def test_each_part_keeps_a_disjoint_share_and_everything_is_restored():
    assert _scaled_copy in autotune_parts.autotuners()
    shares = []
    for part in range(4):
        _scaled_copy.cache[("picked", part)] = CONFIGS[0]  # what autotuning inside the block would leave behind
        with autotune_parts.config_part(part, 4) as n:
            assert n >= 2  # at least this module's two autotuners
            shares.append(list(_scaled_copy.configs))
            _scaled_copy.cache[("inside", part)] = CONFIGS[1]
            # fewer configurations than parts: one each (and the first), so every process compiles something
            assert _two_configs.configs == ([CONFIGS[0]] if part % 2 == 0 else [CONFIGS[0], CONFIGS[1]])
        assert _scaled_copy.configs == CONFIGS and _two_configs.configs == CONFIGS[:2]
        assert ("inside", part) not in _scaled_copy.cache and ("picked", part) in _scaled_copy.cache
    # every share keeps the first configuration (the smallest tiles in fla-core's lists): a share whose own
    # configurations all exceed shared memory still launches
    assert shares == [[CONFIGS[0], CONFIGS[4]], [CONFIGS[0], CONFIGS[1], CONFIGS[5]], [CONFIGS[0], CONFIGS[2]],
                      [CONFIGS[0], CONFIGS[3]]]
    own = [share[1:] if i else share for i, share in enumerate(shares)]
    assert sorted(map(str, sum(own, []))) == sorted(map(str, CONFIGS))  # disjoint and complete besides the first


@pytest.mark.parametrize("part,parts", [(-1, 2), (2, 2), (0, 0), (1.0, 2)])
def test_bad_parts_are_refused(part, parts):
    with pytest.raises(ValueError, match="config_part: part must be in"):
        with autotune_parts.config_part(part, parts):
            pass


def test_the_fla_package_of_every_operator():
    assert set(autotune_parts.FLA_PACKAGES) == {"deltanet", "gdn", "kda", "gdn2"}


def test_a_warm_request_with_a_part_restricts_fla_autotuners_while_it_runs(monkeypatch):
    from rewy_tune import trial_worker

    seen = []

    def fake_shapes(msg):
        fla = [t for t in autotune_parts.autotuners() if t.fn.__module__.startswith("fla.")]
        seen.append((list(_scaled_copy.configs), len(fla)))
        return {"status": "ok"}

    monkeypatch.setattr(trial_worker, "_warm_shapes", fake_shapes)
    msg = dict(kind="warm", op="gdn2", policy="R", K=128, V=128, device="cuda", shapes=[[1, 512, 4]], ours=False,
               with_fla=True, autotune_part=[1, 3])
    assert trial_worker._warm(msg) == {"status": "ok"}
    (configs, n_fla), = seen
    assert configs == [CONFIGS[0], *CONFIGS[1::3]] and n_fla > 0  # fla-core's gdn2 package was imported and its tuners split
    assert _scaled_copy.configs == CONFIGS


def test_picks_names_each_kernel_and_its_chosen_configuration_per_key(monkeypatch):
    # what a bench records of FLA's autotuners: only the modules under the prefix, only kernels that picked
    _scaled_copy.cache.clear()
    _two_configs.cache.clear()
    assert autotune_parts.picks(__name__) == {}
    _scaled_copy.cache[(128, "torch.float32")] = CONFIGS[3]
    got = autotune_parts.picks(__name__)
    assert list(got) == [f"{__name__}._scaled_copy"]
    assert got[f"{__name__}._scaled_copy"] == {str((128, "torch.float32")): str(CONFIGS[3])}
    assert "BLOCK: 32" in str(CONFIGS[3]) and "num_warps: 2" in str(CONFIGS[3])
    assert autotune_parts.picks("fla.") == {}  # nothing of fla-core imported or picked here
    _scaled_copy.cache.clear()


def test_finding_the_autotuners_reads_no_other_objects_attributes():
    # isinstance(o, Autotuner) read o.__class__ of every live object, and torch's deprecated
    # torch.distributed.reduce_op warns when that is read: a FutureWarning per bench and campaign process
    class FailsWhenItsClassIsRead:
        @property
        def __class__(self):
            pytest.fail("autotuners() read an object's __class__")

    probe = FailsWhenItsClassIsRead()
    assert _scaled_copy in autotune_parts.autotuners()
    del probe
