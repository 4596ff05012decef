"""How the trainer steps on a GPU, checked on every device: micro-steps sized by tokens, statistics read every N
steps, fused AdamW and TF32 matmuls on CUDA only (with the flag restored), and bf16 autocast or float32 alike."""

from __future__ import annotations

import pytest
import torch

from drafter.decode.engine import Engine
from drafter.draft.head import new_head
from drafter.model.config import GPU_TOKENS_PER_STEP, TrainConfig
from drafter.train.buffer import RolloutBuffer
from drafter.train.trainer import DraftTrainer, tf32_matmuls
from drafter.train.warmstart import HarvestConfig, harvest
from tests.conftest import on, random_prompts, tiny_model


@pytest.fixture(scope="module")
def harvested(device):
    """A tiny random policy on `device` and 24 of its rollouts (no structure needed: nothing here learns)."""
    model = on(tiny_model(seed=2), device)
    buffer = RolloutBuffer(max_bytes=16 << 20)
    harvest(Engine(model), random_prompts([5] * 24, model.cfg.vocab_size, seed=3), buffer,
            cfg=HarvestConfig(batch_size=24, max_new_tokens=40, temperature=1.0))
    return model, buffer


def offline(**kwargs) -> TrainConfig:
    return TrainConfig(**{"anneal_to_budget": False, "bf16_autocast": False, **kwargs})


def test_micro_steps_are_sized_by_tokens_where_asked_and_on_a_gpu(harvested):
    model, buffer = harvested
    assert TrainConfig().rows_per_step("cpu") == TrainConfig().num_rows  # a CPU's default: unchanged
    assert TrainConfig().rows_per_step("cuda") == GPU_TOKENS_PER_STEP // 256
    assert TrainConfig(tokens_per_step=100).rows_per_step("cuda") == 1  # never no row
    trainer = DraftTrainer(model, new_head(model, None, None), offline(tokens_per_step=64, max_tokens_per_row=32))
    assert trainer.num_rows == 2
    batch = trainer.next_batch(buffer)
    assert batch.feats.shape[0] == 2 and batch.feats.shape[1] <= 32
    default = DraftTrainer(model, new_head(model, None, None), offline())
    assert default.num_rows == (GPU_TOKENS_PER_STEP // 256 if model.device.type == "cuda" else 4)
    with pytest.raises(ValueError, match="tokens_per_step must be >= 1"):
        TrainConfig(tokens_per_step=0)


def test_statistics_are_read_every_n_steps_and_every_step_is_reported(harvested):
    """With stats_every 4, on_step is called for steps 1..10 in order, but only when 4 steps (or the end) have run:
    the figures of a step are read with those of the steps after it, in one transfer."""
    model, buffer = harvested
    trainer = DraftTrainer(model, new_head(model, None, None), offline(stats_every=4))
    calls = []
    report = trainer.train(buffer, max_steps=10, on_step=lambda step, stats: calls.append((step, trainer.step, stats)))
    assert [step for step, _, _ in calls] == list(range(1, 11))
    assert [done for _, done, _ in calls] == [4] * 4 + [8] * 4 + [10] * 2  # steps taken when each was reported
    assert len(report.losses) == 10 and report.losses[-1] == calls[-1][2]["loss"] == report.last_stats["loss"]
    assert all(isinstance(v, float) for _, _, stats in calls for v in stats.values())
    with pytest.raises(ValueError, match="stats_every must be >= 1"):
        TrainConfig(stats_every=0)


def test_fused_adamw_and_tf32_on_a_gpu_only_with_the_flag_restored(harvested):
    model, buffer = harvested
    trainer = DraftTrainer(model, new_head(model, None, None), offline())
    is_cuda = model.device.type == "cuda"
    assert bool(trainer.optimizer.defaults.get("fused")) == is_cuda
    before = torch.backends.cuda.matmul.allow_tf32
    seen = []
    with tf32_matmuls(model.device, True):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
    assert seen == [True if is_cuda else before] and torch.backends.cuda.matmul.allow_tf32 == before
    with tf32_matmuls(model.device, False):
        assert torch.backends.cuda.matmul.allow_tf32 == before
    trainer.train(buffer, max_steps=2)
    assert torch.backends.cuda.matmul.allow_tf32 == before  # a training step leaves the serving policy's precision


@pytest.mark.parametrize("bf16", ["autocast", "weights"])
def test_bf16_and_float32_follow_the_same_loss_curve(harvested, bf16):
    """The loss of 20 micro-steps on a fixed batch, in bf16 (autocast, or pure bf16 weights with float32 masters)
    and in float32 from the same start: equal to bf16 rounding at every step (the precision changes the speed, not
    what is learnt). The head's weights and AdamW's moments stay float32."""
    model, buffer = harvested
    curves = {}
    for name, kwargs in (("fp32", {}), (bf16, {"autocast": {"bf16_autocast": True},
                                               "weights": {"bf16_weights": True}}[bf16])):
        torch.manual_seed(0)
        head = new_head(model, None, None)
        trainer = DraftTrainer(model, head, offline(warmup_steps=1, **kwargs))
        batch = trainer.next_batch(buffer)
        curves[name] = [trainer.micro_step(batch)["loss"] for _ in range(20)]
        assert all(p.dtype == torch.float32 for p in head.parameters())
        assert all(s.dtype == torch.float32 for st in trainer.optimizer.state.values() for s in st.values()
                   if torch.is_tensor(s) and s.is_floating_point())
    assert curves["fp32"][-1] < 0.8 * curves["fp32"][0]  # it learns
    for fp32, low in zip(curves["fp32"], curves[bf16], strict=True):
        assert low == pytest.approx(fp32, rel=0.03)
    with pytest.raises(ValueError, match="bf16_weights and bf16_autocast"):
        TrainConfig(bf16_weights=True, bf16_autocast=True)


def test_batches_packed_ahead_train_as_batches_packed_in_turn(harvested):
    """On a GPU the trainer packs the next batch on the host while a step runs (forced here on every device): the
    same batches in the same order, so the same weights, across train() calls that end on a step budget."""
    from concurrent.futures import ThreadPoolExecutor

    model, buffer = harvested
    heads = []
    for ahead in (False, True):
        torch.manual_seed(0)
        trainer = DraftTrainer(model, new_head(model, None, None), offline(num_rows=2, max_tokens_per_row=64))
        trainer._packer = ThreadPoolExecutor(1) if ahead else None
        for _ in range(2):
            trainer.train(buffer, max_steps=3)
        assert (trainer._packed is not None) == ahead  # the batch packed for a 7th step waits for the next call
        heads.append(trainer.head)
    # bitwise on a CPU; on CUDA an atomic-add backward (index_select's) sums in no fixed order, while a batch out
    # of order would move the weights by about the rate (1e-3)
    exact = model.device.type == "cpu"
    for a, b in zip(heads[0].parameters(), heads[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-6)
    assert (DraftTrainer(model, new_head(model, None, None), offline())._packer is not None) == \
        (model.device.type == "cuda")


def test_batches_keep_the_buffers_dtype_until_they_reach_the_head(harvested):
    """A bf16 buffer packs bf16 features (half the bytes to pack and to move); the loss computes in the head's
    dtype all the same: equal to the loss of the batch converted first."""
    from drafter.train.trainer import draft_loss

    model, buffer = harvested
    head = new_head(model, None, None)
    trainer = DraftTrainer(model, head, offline())
    batch = trainer.next_batch(buffer)
    assert batch.feats.dtype == buffer.hidden_dtype == torch.bfloat16
    loss, _ = draft_loss(head, model, batch.to(model.device), offline())
    converted, _ = draft_loss(head, model, batch.to(model.device, torch.float32), offline())
    assert loss.dtype == torch.float32 and torch.equal(loss, converted)


def test_a_stop_is_not_kept_waiting_for_a_batch_being_packed(harvested):
    """On a GPU a step may wait for its batch to be packed (forced here on every device, the packing slowed to
    2 s): a stop requested then ends train() at once; the batch is the next call's first."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    model, buffer = harvested
    trainer = DraftTrainer(model, new_head(model, None, None), offline())
    trainer._packer = ThreadPoolExecutor(1)
    packed = trainer.next_batch
    trainer.next_batch = lambda buf: time.sleep(2.0) or packed(buf)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("report", trainer.train(buffer, max_seconds=60)))
    thread.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    trainer.request_stop()
    thread.join(timeout=30)
    assert time.perf_counter() - t0 < 1.0 and result["report"].stopped and result["report"].num_steps == 0
    trainer.stop_event.clear()
    trainer.next_batch = packed
    assert trainer.train(buffer, max_steps=2).num_steps == 2  # the batch packed meanwhile trains first
