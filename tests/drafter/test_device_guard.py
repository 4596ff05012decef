"""Device guard: the code the engine and the trainer run creates no tensor without saying where.

A tensor factory (torch.zeros, torch.tensor, torch.arange, ...) called without `device=` lands on the CPU
whatever device the module it feeds is on: the first H100 run failed at its first training step on exactly
that. Every factory in these files names its device, taken from the module it feeds (`policy.device`,
`head.fc.weight.device`) or "cpu" where the CPU is meant (the rollout buffer's storage, checkpoint files).
`*_like` and `Tensor.new_*` inherit a device and are fine. ALLOWED lists the few calls that stay as they are,
each with its reason; an entry that no longer matches a call fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# what the engine, drafting, harvest, training, warm start, evaluation, merging, swap and the learner run
SCANNED = sorted({*(p.relative_to(ROOT).as_posix() for p in (ROOT / "drafter").rglob("*.py")),
                  "workers/builtin_engine.py", "workers/grpo.py", "workers/learner_pairs.py", "workers/leases.py",
                  "workers/scoring.py", "workers/store.py", "workers/swap.py", "workers/warm.py", "bench/drafter.py",
                  "bench/drift.py"})

# torch functions that make a new tensor and take `device=`
FACTORIES = frozenset({
    "arange", "as_tensor", "complex", "empty", "empty_strided", "eye", "full", "linspace", "logspace", "normal",
    "ones", "polar", "rand", "randint", "randn", "randperm", "range", "scalar_tensor", "sparse_coo_tensor", "tensor",
    "tril_indices", "triu_indices", "zeros",
})

# (file, function): why its device-less factories stay.
ALLOWED = {
    ("drafter/draft/head.py", "EagleHead.__init__"):
        "a module constructor: its vocab_ids buffer follows the construction device as nn.Linear's weights do "
        "(a torch.device context, e.g. head_from_state's meta device, or .to() after)",
}


def violations(source: str, filename: str = "<source>") -> list[tuple[str, int, str]]:
    """(qualified function, line, factory) of every factory call in `source` without a device= keyword."""
    found: list[tuple[str, int, str]] = []
    scope: list[str] = []

    class Visitor(ast.NodeVisitor):
        def visit_FunctionDef(self, node: ast.AST) -> None:
            scope.append(node.name)
            self.generic_visit(node)
            scope.pop()

        visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef  # noqa: N815 (ast's method names)

        def visit_Call(self, node: ast.Call) -> None:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in FACTORIES and isinstance(f.value, ast.Name)
                    and f.value.id == "torch" and not any(k.arg == "device" for k in node.keywords)):
                found.append((".".join(scope) or "<module>", node.lineno, f"torch.{f.attr}"))
            self.generic_visit(node)

    Visitor().visit(ast.parse(source, filename=filename))
    return found


def test_every_tensor_factory_names_its_device():
    bad, used = [], set()
    for path in SCANNED:
        for function, line, call in violations((ROOT / path).read_text(), path):
            if (path, function) in ALLOWED:
                used.add((path, function))
            else:
                bad.append(f"{path}:{line} {function}: {call}(...) without device=")
    assert not bad, ("tensors made without a device land on the CPU, whatever the module they feed is on; take the "
                     "device from that module (policy.device, head.fc.weight.device), or say device='cpu':\n"
                     + "\n".join(bad))
    # a file not there yet (another engineer's, not committed) keeps its entry
    stale = [f"{p}: {fn}" for p, fn in ALLOWED if (p, fn) not in used and (ROOT / p).is_file()]
    assert not stale, "ALLOWED entries that no longer match a call (remove them):\n" + "\n".join(stale)


def test_the_guard_sees_a_new_factory():
    """A torch.zeros(3) added to the trainer is caught, with its place; one that names its device is not."""
    source = (ROOT / "drafter" / "train" / "trainer.py").read_text()
    added = source + "\n\ndef fresh():\n    return torch.zeros(3), torch.zeros(3, device='cpu'), x.new_zeros(3)\n"
    assert violations(source) == []
    assert [(fn, call) for fn, _, call in violations(added)] == [("fresh", "torch.zeros")]
    assert {"drafter/train/trainer.py", "drafter/decode/engine.py", "drafter/model/causal_lm.py",
            "workers/builtin_engine.py"} <= set(SCANNED)
