"""Notebook 10's exercise 10.4: the rejection sampler that verifies one sequence's drafts.

The learner writes `verify_drafts(probs, drafts, uniforms, sample)`: vLLM's rejection
sampler for a draft that is a point mass (an n-gram proposer's draft is certain, q(x) = 1),
the engine's `minilib.engine.spec_decode._verify_one` for one sequence, in NumPy.

The checker gives the function its own random numbers: `uniforms` (one per draft) and
`sample`, a draw from a distribution by the Gumbel-max trick with noise fixed per case
(`gumbel_sampler`). So the right tokens are known exactly, case by case:

* greedy cases (one-hot rows, temperature 0): the tokens must be the argmax path, drafts
  kept while they equal the argmax, then the argmax;
* sampled cases with chosen draws, each a situation one of the classic mistakes gets wrong
  (the mistake is named only when the learner's tokens are the ones it gives);
* a distribution case: 2000 draws with fresh random numbers, whose outputs must follow the
  exact distribution of the target model (a chi-square test at a fixed seed).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import numpy as np

from minilib.exercises.checking import Case, CheckResult, diagnose, run_check
from minilib.exercises.comparisons import Mismatch, describe

__all__ = ["check_verify_drafts", "exact_output_distribution", "gumbel_sampler", "verify_drafts"]

NUM_DRAWS = 2000  # the distribution case's draws
Z_0001 = 3.0902  # the normal quantile of 1 - 0.001: the chi-square test's significance 0.001


def verify_drafts(probs, drafts, uniforms, sample) -> list[int]:
    """The tokens one verification step gives a sequence (vLLM's rejection sampler, a draft
    that is a point mass).

      probs:     f[k + 1, vocab_size]  the target's distribution at each draft's position
                                       (row i checks draft i) and after the last (row k)
      drafts:    int[k]                the draft tokens x_0 .. x_{k-1}
      uniforms:  f[k]                  one uniform draw in [0, 1) per draft
      sample:    sample(p) -> int      a draw from p, f[vocab_size] summing to 1
      returns    list[int]             the kept drafts, then one token: 1 to k + 1 tokens

    >>> probs = np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    >>> verify_drafts(probs, [1], [0.3], sample=lambda p: int(np.argmax(p)))   # kept: bonus
    [1, 2]
    >>> verify_drafts(probs, [1], [0.7], sample=lambda p: int(np.argmax(p)))   # replaced
    [0]
    """
    probs = np.asarray(probs, dtype=np.float64)
    tokens = []
    for i, draft in enumerate(np.asarray(drafts).tolist()):
        if uniforms[i] < probs[i, draft]:  # kept with probability min(1, p(x) / q(x)), q = 1
            tokens.append(draft)
            continue
        residual = probs[i].copy()  # max(p - q, 0): p with the draft's mass taken out
        residual[draft] = 0.0
        tokens.append(sample(residual / residual.sum()))
        return tokens
    tokens.append(sample(probs[len(tokens)]))  # every draft kept: the bonus token, row k
    return tokens


def gumbel_sampler(noise) -> Callable:
    """`sample(p) -> int`: argmax(log p + noise), a draw from p when `noise` is Gumbel noise
    (the Gumbel-max trick, the engine's sampler). `noise` f[vocab_size] is fixed, so the
    draw is a function of p; a p that is not a distribution raises a ValueError.

    >>> sample = gumbel_sampler(np.array([0.0, 1.0, 0.0]))
    >>> sample(np.array([0.5, 0.25, 0.25])), sample(np.array([0.5, 0.0, 0.5]))
    (1, 0)
    """
    noise = np.asarray(noise, dtype=np.float64)

    def sample(p) -> int:
        p = np.asarray(p, dtype=np.float64)
        total = float(p.sum()) if p.shape == noise.shape else float("nan")
        if p.shape != noise.shape or not np.all(p >= 0) or not abs(total - 1.0) < 1e-4:
            raise ValueError(
                f"sample(p): p must hold the probabilities of the {noise.size} tokens, none "
                f"negative, summing to 1; got {describe(p)} with sum {total:.4g}.\n"
                "  After taking a token's mass out of a row, renormalise: p / p.sum(). "
                "Nothing is left\n  to renormalise only when the row was all on that "
                "token: a draft with p_i(x_i) = 1\n  is always kept (u_i < 1)."
            )
        with np.errstate(divide="ignore"):
            return int(np.argmax(np.log(p) + noise))

    return sample


def exact_output_distribution(probs, drafts) -> dict[tuple, float]:
    """Each possible output of `verify_drafts` and its probability when the draws are
    random: token j of the output is drawn from row j while the tokens before it were the
    drafts, and the output ends at the first token that is not its draft, or after the
    bonus token. Rejection sampling keeps exactly this, the target model's distribution.

    >>> exact_output_distribution(np.array([[0.25, 0.75], [0.5, 0.5]]), [1])
    {(0,): 0.25, (1, 0): 0.375, (1, 1): 0.375}
    """
    probs = np.asarray(probs, dtype=np.float64)
    drafts = np.asarray(drafts).tolist()
    exact = {}
    prefix_probability = 1.0
    for i in range(len(drafts) + 1):
        for token in range(probs.shape[1]):
            if i < len(drafts) and token == drafts[i]:
                continue  # the output goes on past this token
            exact[(*drafts[:i], token)] = prefix_probability * float(probs[i, token])
        if i < len(drafts):
            prefix_probability *= float(probs[i, drafts[i]])
    return exact


# --- the classic mistakes, for the likely cause ---------------------------------------------


def _mistaken(keep=None, remove_mass=True, stops=True, bonus=True, bonus_row=0) -> Callable:
    """`verify_drafts` with one mistake: `keep(u, p_row, draft)` for the acceptance rule;
    no mass taken out; going on after a rejection; no bonus token; the bonus drawn from row
    k + bonus_row."""

    def verify(probs, drafts, uniforms, sample):
        probs = np.asarray(probs, dtype=np.float64)
        drafts = np.asarray(drafts).tolist()
        tokens = []
        for i, draft in enumerate(drafts):
            kept = keep(uniforms[i], probs[i], draft) if keep else uniforms[i] < probs[i, draft]
            if kept:
                tokens.append(draft)
                continue
            residual = probs[i].copy()
            if remove_mass:
                residual[draft] = 0.0
            with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0: sample says so
                residual = residual / residual.sum()
            tokens.append(sample(residual))
            if stops:
                return tokens
        if bonus:
            tokens.append(sample(probs[len(drafts) + bonus_row]))
        return tokens

    return verify


def _rejection_mistakes() -> dict[str, Callable]:
    """{the cause a report names: `verify_drafts` with that mistake}."""
    return {
        "a draft is kept with probability p_i(x_i), the target's probability of *that* token: "
        "keep it when u_i < p_i(x_i) (min(1, p / q) with q = 1 for a draft that is certain). "
        "A fixed threshold (p_i(x_i) > 0.5) keeps a likely draft always and an unlikely one "
        "never.": _mistaken(keep=lambda u, p, x: p[x] > 0.5),
        "a draft is kept with probability p_i(x_i), the target's probability of *that* token, "
        "not of the row's most likely token: keep it when u_i < p_i(x_i), not u_i < max(p_i).": (
            _mistaken(keep=lambda u, p, x: u < p.max())
        ),
        "after a rejection, the replacement is drawn from p_i with the rejected draft's mass "
        "taken out (residual[x_i] = 0, then residual / residual.sum()): drawn from p_i itself it "
        "can be the rejected draft again, and that token then comes out too often.": (
            _mistaken(remove_mass=False)
        ),
        "the first rejection ends the output: return right after the replacement token. The "
        "later drafts were guesses that followed the rejected one, so none of them may be kept, "
        "and there is no bonus token then.": _mistaken(stops=False),
        "when every draft is kept, one more token follows: the bonus token, drawn from the last "
        "row, probs[k]. The output always ends with a token of the target's own.": (
            _mistaken(bonus=False)
        ),
        "the bonus token is drawn from the last row, probs[k] (the distribution after the last "
        "draft), not from probs[k - 1], the row that checked the last draft.": (
            _mistaken(bonus_row=-1)
        ),
    }


# --- the cases ------------------------------------------------------------------------------

ROWS = np.array(  # a target's distributions over 4 tokens, one row per position
    [
        [0.6, 0.2, 0.15, 0.05],
        [0.1, 0.3, 0.5, 0.1],
        [0.25, 0.25, 0.05, 0.45],
        [0.1, 0.2, 0.3, 0.4],
    ]
)
GREEDY = np.eye(4)[[2, 0, 3, 1]]  # temperature 0: each row all on its argmax (2, 0, 3, 1)

# (what the case shows, probs, drafts, uniforms, the sampler's noise)
CASES = [
    ("greedy, every draft the argmax", GREEDY, [2, 0, 3], [0.5, 0.9, 0.2], [0, 0, 0, 0]),
    ("greedy, draft 1 not the argmax", GREEDY, [2, 1, 3], [0.3, 0.1, 0.6], [0, 0, 0, 0]),
    ("greedy, draft 0 not the argmax", GREEDY, [1, 0, 3], [0.2, 0.4, 0.1], [0, 0, 0, 0]),
    ("every draft kept", ROWS, [0, 1, 3], [0.1, 0.1, 0.05], [0.0, 0.0, 1.0, 0.0]),
    ("draft 1 rejected", ROWS, [0, 2, 3], [0.3, 0.7, 0.2], [0.0, 0.0, 0.5, 0.0]),
    ("draft 0 rejected", ROWS, [1, 2, 3], [0.4, 0.3, 0.2], [0.3, 0.0, 0.0, 0.0]),
    ("no drafts: one token of the target's own", ROWS[:1], [], [], [0.0, 0.4, 0.9, 0.0]),
]


def _relabel(probs, drafts, noise, order):
    """The same case with token t called order[t]: the right output, relabelled too."""
    probs = np.asarray(probs, dtype=np.float64)
    relabelled = np.zeros_like(probs)
    relabelled[:, order] = probs
    moved = np.zeros(len(order))
    moved[order] = noise
    return relabelled, [int(order[x]) for x in drafts], moved


def _cases(seed: int) -> list[Case]:
    rng = np.random.default_rng(1040 + seed)
    cases = []
    for what, probs, drafts, uniforms, noise in CASES:
        order = rng.permutation(4) if seed else np.arange(4)  # seed 0: the tokens as written
        probs, drafts, noise = _relabel(probs, drafts, noise, order)
        kind = "greedy" if what.startswith("greedy") else "sampled"
        kept = [round(float(probs[i, x]), 2) for i, x in enumerate(drafts)]
        description = (
            f"{what}: drafts {drafts}, their probabilities p_i(x_i) {kept}, uniforms "
            f"{uniforms}, {len(probs)} rows of probs"
        )
        cases.append(Case(description, (kind, probs, drafts, np.array(uniforms), noise)))
    cases.append(
        Case(
            f"{NUM_DRAWS} draws with random uniforms and samples: the outputs' distribution "
            "against the target model's (a chi-square test)",
            ("distribution", ROWS[:3], [0, 2], None, 1040 + seed),
        )
    )
    return cases


def _argmax_path(probs, drafts) -> list[int]:
    """Greedy verification: drafts kept while each is its row's argmax, then the argmax."""
    tokens = []
    for i, draft in enumerate(drafts):
        if draft != int(np.argmax(probs[i])):
            break
        tokens.append(draft)
    return [*tokens, int(np.argmax(probs[len(tokens)]))]


def _draw_outputs(fn, probs, drafts, seed: int) -> Counter:
    """How often each output came out of `fn` over NUM_DRAWS draws of fresh random numbers."""
    rng = np.random.default_rng(seed)
    counts = Counter()
    for _ in range(NUM_DRAWS):
        uniforms = rng.random(len(drafts))
        sample = gumbel_sampler(rng.gumbel(size=probs.shape[1]))
        counts[_as_tokens(fn(probs, np.array(drafts), uniforms, sample))] += 1
    return counts


# --- comparing ------------------------------------------------------------------------------


def _as_tokens(got) -> tuple[int, ...]:
    """The learner's output as a tuple of ints, or a Mismatch saying what it is instead."""
    values = None
    if not isinstance(got, str | bytes) and got is not None:
        try:
            values = np.asarray(got)
        except Exception:  # a list of things NumPy cannot put in one array
            values = None
    if values is not None and values.ndim == 1 and values.size == 0:
        return ()
    if values is None or values.ndim != 1 or values.dtype.kind not in "iu":
        items = f" (its first item: {describe(got[0])})" if isinstance(got, list | tuple) else ""
        raise Mismatch(
            f"tokens: expected a list of token ids (ints), got {describe(got)}{items}.\n"
            "  Return the kept drafts and the one token after them, e.g. [2, 0, 1]."
        )
    return tuple(int(t) for t in values)


def _compare_tokens(expected, got, case: Case) -> None:
    got = _as_tokens(got)
    if got != tuple(expected):
        raise Mismatch(f"tokens: expected {list(expected)}, got {list(got)}")


def chi_square_limit(degrees_of_freedom: int) -> float:
    """The chi-square statistic that a right answer exceeds with probability 0.001
    (Wilson and Hilferty's approximation: a little above the exact value, by 1.2 % at 5
    degrees of freedom and less after, so a right answer fails a little less often).

    >>> round(chi_square_limit(9), 2)      # a table of the chi-square gives 27.88
    28.06
    """
    a = 2 / (9 * degrees_of_freedom)
    return degrees_of_freedom * (1 - a + Z_0001 * math.sqrt(a)) ** 3


def _compare_distribution(exact: dict, counts: Counter, case: Case) -> None:
    impossible = [output for output in counts if exact.get(output, 0.0) == 0.0]
    if impossible:
        raise Mismatch(
            f"outputs: {list(impossible[0])} came out {counts[impossible[0]]} times in "
            f"{NUM_DRAWS} draws, an output the target model never gives."
        )
    statistic = sum(
        (counts[output] - NUM_DRAWS * p) ** 2 / (NUM_DRAWS * p) for output, p in exact.items()
    )
    limit = chi_square_limit(len(exact) - 1)
    if statistic > limit:
        raise Mismatch(
            f"the outputs of {NUM_DRAWS} draws do not follow the target model's distribution "
            f"(chi-square {statistic:.0f}, above {limit:.0f}: a right answer exceeds it once "
            f"in 1000 runs).\n{_distribution_table(exact, counts)}"
        )


def _distribution_table(exact: dict, counts: Counter) -> str:
    """The first token's and the number of kept drafts' frequencies, expected and got."""
    lines = []
    for name, key in (("first token", lambda o: o[0]), ("drafts kept", lambda o: len(o) - 1)):
        want, have = Counter(), Counter()
        for output, p in exact.items():
            want[key(output)] += p
        for output, n in counts.items():
            have[key(output)] += n / NUM_DRAWS
        values = sorted(want)
        lines.append(f"  {name:11s} {' '.join(f'{v:>6}' for v in values)}")
        lines.append(f"    expected  {' '.join(f'{want[v]:6.3f}' for v in values)}")
        lines.append(f"    got       {' '.join(f'{have[v]:6.3f}' for v in values)}")
    return "\n".join(lines)


def check_verify_drafts(fn: Callable, *, seed: int = 0, verbose: bool = True) -> CheckResult:
    """Check `fn(probs, drafts, uniforms, sample) -> list[int]`, the verification of one
    sequence's drafts (`verify_drafts`): greedy cases must give the argmax path, sampled
    cases the tokens rejection sampling gives with the checker's draws, and 2000 fresh draws
    the target model's distribution of outputs.

    >>> check_verify_drafts(verify_drafts)
    Passed: verify_drafts matches the reference on all 8 cases.
    CheckResult('verify_drafts', status='passed')
    """

    def call(f):
        def run(kind, probs, drafts, uniforms, noise):
            if kind == "distribution":
                return _draw_outputs(f, probs, drafts, seed=noise)
            return f(probs, np.array(drafts, dtype=np.int32), uniforms, gumbel_sampler(noise))

        return run

    def reference(kind, probs, drafts, uniforms, noise):
        if kind == "distribution":
            return exact_output_distribution(probs, drafts)
        if kind == "greedy":
            return _argmax_path(probs, drafts)
        return call(verify_drafts)(kind, probs, drafts, uniforms, noise)

    mistakes = {cause: call(mistaken) for cause, mistaken in _rejection_mistakes().items()}
    tokens = diagnose(_compare_tokens, mistakes)

    def compare(expected, got, case):
        if case.args[0] == "distribution":
            _compare_distribution(expected, got, case)
        else:
            tokens(expected, got, case)

    return run_check(
        "verify_drafts",
        call(fn),
        reference,
        _cases(seed),
        compare,
        verbose=verbose,
        check_answer_type=False,
    )
