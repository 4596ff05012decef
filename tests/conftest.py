"""Shared fixtures: tiny random models (fast, for exactness tests) built in-test."""

from __future__ import annotations

import collections
import copy
import importlib.util

import pytest
import torch

from drafter.model.causal_lm import CausalLM
from drafter.model.config import ModelConfig

# The modules that start a Ray cluster (in this process, with `ray start`, or through `tlt serve` / `tlt bench rl`)
# and run jobs on it. Under `make test` (pytest-xdist, --dist loadfile) they are one unit of work, run one after
# another in one process: two clusters' jobs at once on 2 cores starved a `ray start` node of its GCS for minutes.
RAY_MODULES = frozenset(f"tests/{m}.py" for m in (
    "scheduler/test_multinode", "scheduler/test_restart", "scheduler/test_ray_join", "scheduler/test_serve",
    "scheduler/test_queue", "scheduler/test_durability", "scheduler/test_api", "scheduler/test_watcher",
    "scheduler/test_watcher_gone", "scheduler/test_redis_outage", "scheduler/test_cli", "scheduler/test_commands",
    "scheduler/test_scoring", "deploy/test_observability", "workers/test_job", "workers/test_learner_pairs_job",
    "workers/test_swap_kill", "workers/test_swap_guard", "workers/test_warm", "bench/test_rl_device",
    "bench/test_rl_gpu_path", "bench/test_rl_coupled"))


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under --dist loadfile: its module, or "ray" for RAY_MODULES."""
    module = nodeid.split("::")[0]
    return "ray" if module in RAY_MODULES else module


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without xdist (a bare GPU node) it is never called
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with RAY_MODULES as one unit (xdist's own xdist_group marks do not reach its scheduler under
    pytest 9: the suffix they add to a test's id is lost)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LoadFileRayTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return LoadFileRayTogether(config, log)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's, called in the controller
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """Refuse test ids that name several tests: xdist sends tests by id, so it would run one of them."""
    shared = sorted(nodeid for nodeid, n in collections.Counter(ids).items() if n > 1)
    if shared:
        pytest.exit(f"{len(shared)} test ids name several tests each, which pytest-xdist would run once: "
                    f"{shared[:3]}; run their modules without -n (the Makefile's SERIAL_TESTS)",
                    returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked vllm run where vllm is importable (.venv-engines: `make test` runs them there with -m vllm);
    elsewhere they are skipped, saying why. vllm installed but broken fails them: it never skips them."""
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm is not installed in this venv: `make test` runs these in .venv-engines")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the cuda case runs on a GPU "
                             "node (the set in tests/cuda_tests.txt, `python3 -m pytest -q -k cuda ...`)")


@pytest.fixture(scope="session", params=["cpu", pytest.param("cuda", marks=NO_CUDA)], ids=["cpu", "cuda"])
def device(request) -> str:
    """Where a device-parametrized test puts its models: "cpu", and "cuda" where a GPU is present (skipped
    elsewhere). Session-scoped, so module fixtures can build their models on it."""
    return request.param


def on(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """`model` on `device`: itself on the CPU, a copy elsewhere (session fixtures are shared, never moved)."""
    return model if torch.device(device).type == "cpu" else copy.deepcopy(model).to(device)


def tiny_model(vocab_size: int = 64, seed: int = 0, std: float = 0.3, max_position: int = 512,
               attention_bias: bool = False, tie: bool = True, eos: tuple[int, ...] = ()) -> CausalLM:
    """A 2-layer model with large random weights: peaked, repetitive outputs, so drafts get accepted."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position=max_position, attention_bias=attention_bias,
                      tie_word_embeddings=tie, eos_token_ids=eos)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, std)
    return model.requires_grad_(False)


@pytest.fixture(scope="session")
def tiny() -> CausalLM:
    return tiny_model()


@pytest.fixture(scope="session")
def tiny_qwen2() -> CausalLM:
    return tiny_model(seed=1, attention_bias=True, tie=False)


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def pattern_corpus(num_seqs: int, vocab_size: int = 48, seed: int = 0, length: int = 48) -> torch.Tensor:
    """Sequences of fixed multi-token 'words' in random order: within a word the next token is
    certain, across words it is not. A policy trained on it has structure a drafter can learn."""
    g = torch.Generator().manual_seed(1234)  # the words are fixed; `seed` only orders them
    words = [torch.randint(0, vocab_size, (int(n),), generator=g).tolist()
             for n in torch.randint(3, 7, (12,), generator=g)]
    rng = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(num_seqs):
        seq: list[int] = []
        while len(seq) < length:
            seq += words[int(torch.randint(0, len(words), (1,), generator=rng))]
        seqs.append(seq[:length])
    return torch.tensor(seqs)


_STRUCTURED: dict = {}


def fit_patterns(model: CausalLM, steps: int, batch_size: int) -> CausalLM:
    """Train `model` (in place) `steps` AdamW steps on pattern_corpus over its vocabulary; returns it frozen
    for inference."""
    model.requires_grad_(True).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        ids = pattern_corpus(batch_size, model.cfg.vocab_size, seed=step)  # (B, L)
        B, L = ids.shape
        logits, _ = model(ids, torch.arange(L).expand(B, L), None)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


def structured_model(vocab_size: int = 48, steps: int = 300) -> CausalLM:
    """A tiny policy trained a few hundred steps on pattern_corpus (cached per process)."""
    key = (vocab_size, steps)
    if key not in _STRUCTURED:
        torch.manual_seed(0)
        _STRUCTURED[key] = fit_patterns(tiny_model(vocab_size=vocab_size, seed=0, std=0.02), steps, batch_size=32)
    return _STRUCTURED[key]
