"""The train/inference agreement check: for every trained token of an exported row, the trainer's
own logprob against the engine's (`response_logprobs`), the figure RL users look at first.

One forward pass of the trainer's weights over `prompt_ids + response_ids` gives, at position
t - 1, the distribution of token t; its log-softmax (after `temperature`, as the engine reports
it) at the token that was sampled is the trainer's logprob. Only tokens with `loss_mask` 1 are
compared: the others were not sampled (tool results, harness messages) and carry 0.0.

A row whose trained tokens mostly disagree is not noise but a misalignment — an off-by-one
between ids and logprobs, rows of another model, or another temperature — and fails loudly
(`Misaligned`), naming the shift that would line it up when there is one. `polar-mitm
check-logprobs` is the command; `check` the function (torch and transformers: the `[hf]` extra).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# A row is misaligned when at least this share of its trained tokens is over the tolerance
# (and it has enough of them to tell).
MISALIGNED_SHARE = 0.5
MISALIGNED_MIN_TOKENS = 4


class Misaligned(ValueError):
    """Rows whose logprobs cannot belong to their tokens: the message says which and why."""


@dataclass
class RowAgreement:
    trajectory_id: str
    tokens: int  # trained tokens compared
    max_abs: float
    mean_abs: float
    over: float  # share of trained tokens over the tolerance
    shift: int | None = None  # for a misaligned row: the shift that lines the logprobs up, if any


@dataclass
class Agreement:
    tolerance: float
    rows: list[RowAgreement] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.rows)

    @property
    def max_abs(self) -> float:
        return max((r.max_abs for r in self.rows if r.tokens), default=0.0)

    @property
    def mean_abs(self) -> float:
        n = self.tokens
        return sum(r.mean_abs * r.tokens for r in self.rows) / n if n else 0.0

    @property
    def over(self) -> float:
        n = self.tokens
        return sum(r.over * r.tokens for r in self.rows) / n if n else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "tolerance": self.tolerance,
            "rows": len(self.rows),
            "tokens": self.tokens,
            "max_abs": self.max_abs,
            "mean_abs": self.mean_abs,
            "over": self.over,
            "per_row": [r.__dict__ for r in self.rows],
        }


def trainer_logprobs(
    model: Any, prompt_ids: Sequence[int], response_ids: Sequence[int], temperature: float = 1.0
) -> Any:
    """The model's logprob of each response token (a float32 tensor), from one forward pass."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(1, torch.tensor(list(response_ids), dtype=torch.long)[:, None])[:, 0]


def _field(row: Any, name: str) -> Any:
    return row[name] if isinstance(row, Mapping) else getattr(row, name)


def _over(a: Any, b: Any, tolerance: float) -> float:
    return float(((a - b).abs() > tolerance).float().mean()) if len(a) else 0.0


def check_row(model: Any, row: Any, tolerance: float = 1e-4, temperature: float = 1.0) -> RowAgreement:
    """One row (a parquet row as a dict, or a `Trajectory`) against the model."""
    import torch

    tid = str(_field(row, "trajectory_id"))
    prompt, response = list(_field(row, "prompt_ids")), list(_field(row, "response_ids"))
    mask, engine = list(_field(row, "loss_mask")), list(_field(row, "response_logprobs"))
    if not (len(mask) == len(engine) == len(response)):
        raise Misaligned(
            f"row {tid}: {len(response)} response ids, {len(mask)} loss_mask entries and "
            f"{len(engine)} response_logprobs: they must be one per response token"
        )
    if not prompt:
        raise Misaligned(f"row {tid}: no prompt ids (the first response token has no context)")
    trained = torch.tensor([m == 1 for m in mask], dtype=torch.bool)
    if not trained.any():
        return RowAgreement(tid, 0, 0.0, 0.0, 0.0)
    mine = trainer_logprobs(model, prompt, response, temperature)
    theirs = torch.tensor(engine, dtype=torch.float32)
    diff = (mine[trained] - theirs[trained]).abs()
    result = RowAgreement(
        tid,
        int(trained.sum()),
        float(diff.max()),
        float(diff.mean()),
        float((diff > tolerance).float().mean()),
    )
    if result.tokens >= MISALIGNED_MIN_TOKENS and result.over >= MISALIGNED_SHARE:
        idx = trained.nonzero()[:, 0]
        for shift in (1, -1, 2, -2):
            j = idx + shift
            ok = (j >= 0) & (j < len(response))
            if ok.sum() >= MISALIGNED_MIN_TOKENS and _over(mine[j[ok]], theirs[idx[ok]], tolerance) < 0.1:
                result.shift = shift
                break
    return result


def check(
    model: Any, rows: Iterable[Any], tolerance: float = 1e-4, temperature: float = 1.0, strict: bool = True
) -> Agreement:
    """Every row's agreement; with `strict`, raises `Misaligned` for rows that cannot be right."""
    report = Agreement(tolerance)
    for row in rows:
        report.rows.append(check_row(model, row, tolerance, temperature))
    bad = [r for r in report.rows if r.tokens >= MISALIGNED_MIN_TOKENS and r.over >= MISALIGNED_SHARE]
    if strict and bad:
        r = bad[0]
        why = (
            f"the engine's logprobs match the trainer's with the tokens shifted by {r.shift:+d}: an off-by-one "
            "between ids and logprobs"
            if r.shift is not None
            else "wrong weights (not the ones that sampled), another temperature, or ids and logprobs out of step"
        )
        raise Misaligned(
            f"{len(bad)} of {len(report.rows)} rows look misaligned; row {r.trajectory_id}: "
            f"{r.over:.0%} of {r.tokens} trained tokens differ by more than {tolerance:g} "
            f"(max {r.max_abs:.3g}): {why}"
        )
    return report


def render(report: Agreement, limit: int = 50) -> str:
    lines = [f"{'trajectory':<40} {'tokens':>7} {'max abs':>10} {'mean abs':>10} {'over':>7}"]
    for r in report.rows[:limit]:
        lines.append(
            f"{r.trajectory_id[:40]:<40} {r.tokens:>7} {r.max_abs:>10.3g} {r.mean_abs:>10.3g} {r.over:>7.1%}"
        )
    if len(report.rows) > limit:
        lines.append(f"… {len(report.rows) - limit} more rows")
    lines.append(
        f"{len(report.rows)} rows, {report.tokens} trained tokens: max abs {report.max_abs:.3g}, "
        f"mean abs {report.mean_abs:.3g}, {report.over:.2%} over {report.tolerance:g}"
    )
    return "\n".join(lines)
