"""Draft checkpoints: bit-exact round trips, corruption detection, atomic writes, merges, trainer resume."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from drafter.draft.head import EagleConfig, EagleHead, head_config, head_from_state
from drafter.model.config import ModelConfig
from drafter.train.checkpoint import (
    CheckpointError,
    DraftMeta,
    _write,
    draft_path,
    load_draft,
    load_trainer_state,
    merge_drafts,
    save_draft,
    save_trainer_state,
)

TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position=256)


def meta(version: int = 1, parent: int | None = 0, policy: int = 0, steps: int = 0, total: int = 0,
         tokens: int = 0) -> DraftMeta:
    return DraftMeta(version=version, parent_version=parent, policy_version=policy, num_steps=steps,
                     total_steps=total, num_tokens=tokens, head_config={"policy": TINY.to_dict()})


def mixed_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 4, generator=g),
        "w_t": torch.randn(4, 8, generator=g).t(),  # non-contiguous: saved contiguous
        "b16": torch.randn(5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64) * 3,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_round_trip_bit_exact(tmp_path: Path) -> None:
    state, m = mixed_state(), meta(version=3, parent=2, policy=7, steps=5, total=40, tokens=1234)
    m.extra = {"note": "x", "nested": [1, 2]}
    path = draft_path(tmp_path, 3)
    assert path.name == "draft-v000003.safetensors"
    digest = save_draft(path, state, m)
    assert len(digest) == 64
    loaded, m2 = load_draft(path)
    assert_same(loaded, state)
    assert m2 == m


def test_eagle_head_round_trip(tmp_path: Path) -> None:
    ecfg = EagleConfig(init_seed=3)
    head = EagleHead(TINY, ecfg)
    state = head.state_dict()
    assert not any("rotary" in k for k in state)  # non-persistent buffers stay out
    m = DraftMeta(version=0, parent_version=None, policy_version=0, head_config=head_config(head))
    save_draft(draft_path(tmp_path, 0), state, m)
    loaded, m2 = load_draft(draft_path(tmp_path, 0))
    rebuilt = EagleHead(ModelConfig.from_dict(m2.head_config["policy"]),
                        EagleConfig(**{**m2.head_config["eagle"], "init_seed": 99}))
    rebuilt.load_state_dict(loaded, strict=True)
    assert_same(rebuilt.state_dict(), state)


def test_flipped_byte_is_a_checksum_error(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    save_draft(path, mixed_state(), meta())
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x01  # inside the tensor payload
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum") as e:
        load_draft(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "no_metadata", "missing"])
def test_broken_files_raise_checkpoint_error(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "d.safetensors"
    save_draft(path, mixed_state(), meta())
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"this is not a safetensors file at all\n" * 10)
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "no_metadata":
        save_file({"w": torch.ones(2)}, str(path))
    else:
        path.unlink()
    with pytest.raises(CheckpointError) as e:
        load_draft(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("tlt_meta", ["not json", "[]", '{"version": 1}'])
def test_malformed_meta_with_valid_checksum(tmp_path: Path, tlt_meta: str) -> None:
    path = tmp_path / "d.safetensors"
    _write(path, {"w": torch.ones(2)}, {"kind": "draft", "tlt_meta": tlt_meta})
    with pytest.raises(CheckpointError, match="malformed tlt_meta"):
        load_draft(path)
    bad_type = meta().to_json().replace('"version": 1', '"version": "1"')
    _write(path, {"w": torch.ones(2)}, {"kind": "draft", "tlt_meta": bad_type})
    with pytest.raises(CheckpointError, match="version"):
        load_draft(path)


def test_wrong_kind(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    path = tmp_path / "trainer.safetensors"
    save_trainer_state(path, model.state_dict(), opt, meta(), {})
    with pytest.raises(CheckpointError, match="expected 'draft'"):
        load_draft(path)
    save_draft(path, model.state_dict(), meta())
    with pytest.raises(CheckpointError, match="expected 'trainer'"):
        load_trainer_state(path, model, opt)


def test_failed_save_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = draft_path(tmp_path, 1)
    old = mixed_state(0)
    save_draft(path, old, meta())

    def boom(src, dst) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_draft(path, mixed_state(1), meta(version=2))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    loaded, m = load_draft(path)
    assert_same(loaded, old)
    assert m.version == 1


def test_merge_identical_copies_is_identity() -> None:
    state = mixed_state()
    copies = [({k: t.clone() for k, t in state.items()}, meta(version=v, steps=s)) for v, s in [(1, 1), (2, 2), (3, 7)]]
    merged, m = merge_drafts(copies, new_version=4)
    assert_same(merged, state)
    assert (m.version, m.parent_version, m.num_steps) == (4, 0, 10)


def test_merge_weights_by_steps(device: str) -> None:
    """Merged where the copies are (a worker merges on its own device, or on the CPU as read from files)."""
    bf16 = {"dtype": torch.bfloat16, "device": device}
    a = {"w": torch.tensor([0.0, 4.0], device=device), "h": torch.tensor([2.0, 2.0], **bf16)}
    b = {"w": torch.tensor([4.0, 8.0], device=device), "h": torch.tensor([6.0, 10.0], **bf16)}
    copies = [(a, meta(version=5, parent=3, policy=2, steps=1, total=11, tokens=100)),
              (b, meta(version=6, parent=3, policy=4, steps=3, total=13, tokens=300))]
    merged, m = merge_drafts(copies, new_version=7)
    assert merged["w"].device == a["w"].device
    assert torch.equal(merged["w"].cpu(), torch.tensor([3.0, 7.0]))  # 1/4 a + 3/4 b
    assert torch.equal(merged["h"].cpu(), torch.tensor([5.0, 8.0], dtype=torch.bfloat16))
    assert (m.version, m.parent_version, m.policy_version) == (7, 3, 4)
    assert (m.num_steps, m.total_steps, m.num_tokens) == (4, 14, 400)  # lineage 10 + 1 + 3
    assert m.extra == {"merged_versions": [5, 6], "merge_weights": [0.25, 0.75], "policy_versions": [2, 4]}
    # no steps anywhere: plain mean
    zero = [(a, meta(version=5, parent=3)), (b, meta(version=6, parent=3))]
    merged, m = merge_drafts(zero, new_version=7)
    assert torch.equal(merged["w"].cpu(), torch.tensor([2.0, 6.0]))
    assert m.num_steps == 0


@pytest.mark.parametrize("problem", ["empty", "parent", "keys", "shape", "dtype", "ids", "head_config"])
def test_merge_mismatches_raise(problem: str) -> None:
    if problem == "empty":
        with pytest.raises(ValueError):
            merge_drafts([], new_version=1)
        return
    a, b = mixed_state(0), mixed_state(1)
    ma, mb = meta(version=1), meta(version=2)
    if problem == "parent":
        mb.parent_version = 5
    elif problem == "keys":
        b["extra"] = torch.zeros(1)
    elif problem == "shape":
        b["w"] = torch.zeros(4, 8)
    elif problem == "dtype":
        b["w"] = b["w"].double()
    elif problem == "ids":
        b["ids"] = b["ids"] + 1
    else:
        mb.head_config = {"policy": {}}
    with pytest.raises(ValueError):
        merge_drafts([(a, ma), (b, mb)], new_version=3)


def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, num_steps: int) -> None:
    for step in range(start, start + num_steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1)
    return model, opt


def test_trainer_state_resume_is_bit_exact(tmp_path: Path) -> None:
    model, opt = make(0)
    train(model, opt, 0, 3)
    path = tmp_path / "trainer.safetensors"
    m = meta(version=2, parent=1, steps=3, total=9, tokens=24)
    save_trainer_state(path, model.state_dict(), opt, m, {"micro_step": 6, "tokens_seen": 24, "sched_step": 3})
    train(model, opt, 3, 4)

    fresh, fresh_opt = make(1)  # different init, empty optimizer state
    m2, trainer = load_trainer_state(path, fresh, fresh_opt)
    assert m2 == m and trainer == {"micro_step": 6, "tokens_seen": 24, "sched_step": 3}
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.95)
    train(fresh, fresh_opt, 3, 4)
    assert_same(fresh.state_dict(), model.state_dict())
    for p, q in zip(model.parameters(), fresh.parameters()):
        s, t = opt.state[p], fresh_opt.state[q]
        assert torch.equal(s["step"], t["step"])
        assert torch.equal(s["exp_avg"], t["exp_avg"]) and torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])


def test_trainer_state_that_does_not_fit(tmp_path: Path) -> None:
    model, opt = make(0)
    train(model, opt, 0, 1)
    path = tmp_path / "trainer.safetensors"
    save_trainer_state(path, model.state_dict(), opt, meta(), {})
    other = nn.Linear(6, 3)
    with pytest.raises(CheckpointError, match="does not fit"):
        load_trainer_state(path, other, torch.optim.AdamW(other.parameters()))


def test_head_from_state_holds_the_checkpoint_and_real_rotary_tables(tmp_path: Path, device: str) -> None:
    """The hot-swap load path builds on the meta device: the result must equal a head built the
    plain way, even when the rotary tables are computed for the first time inside that build, and
    sit on the device of the state it was given (its rotary tables too)."""
    from drafter.model.causal_lm import rotary_tables

    head = EagleHead(TINY, EagleConfig(init_seed=3)).to(device)
    rotary_tables.cache_clear()
    rebuilt = head_from_state(head_config(head), {k: v.clone() for k, v in head.state_dict().items()})
    assert not any(t.is_meta for t in [*rebuilt.parameters(), *rebuilt.buffers()])
    assert {t.device for t in [*rebuilt.parameters(), *rebuilt.buffers()]} == {head.fc.weight.device}
    assert torch.equal(rebuilt.rotary.cos, head.rotary.cos) and torch.equal(rebuilt.rotary.sin, head.rotary.sin)
    assert_same(rebuilt.state_dict(), head.state_dict())
    feats, embeds = (torch.randn(1, 4, TINY.hidden_size, device=device) for _ in range(2))
    positions = torch.arange(4, device=device)[None]
    assert torch.equal(rebuilt(feats, embeds, positions, None), head(feats, embeds, positions, None))
    with pytest.raises(ValueError, match="Missing key.*fc.weight"):
        head_from_state(head_config(head), {k: v for k, v in head.state_dict().items() if "fc" not in k})


def test_an_old_layout_checkpoint_is_refused_with_a_clear_error() -> None:
    """A draft of the EAGLE-1-style layout this project used before EAGLE-3 (no format, fc over 2D, layers.0.*)
    must fail to load with a ValueError saying so, never a crash or a half-loaded head."""
    old_config = {"policy": TINY.to_dict(), "eagle": {"num_layers": 1, "draft_vocab_size": None, "init_seed": 0,
                                                       "draft_temperature": 1.0}}
    D = TINY.hidden_size
    old_state = {"fc.weight": torch.zeros(D, 2 * D), "layers.0.input_norm.weight": torch.ones(D),
                 "norm.weight": torch.ones(D), "vocab_ids": torch.arange(TINY.vocab_size)}
    with pytest.raises(ValueError, match="another layout"):
        head_from_state(old_config, old_state)
    new = head_config(EagleHead(TINY))
    with pytest.raises(ValueError, match="do not fit"):  # the new config over old tensors
        head_from_state(new, old_state)
