"""Math and reasoning prompts for the bundled drafter's data, generated procedurally by reasoning-gym (one JSONL).

reasoning-gym is needed only here, not by blockspec:
  pip install --target /tmp/rgenv reasoning-gym==0.1.25
  PYTHONPATH=/tmp/rgenv python tools/prepare_math_prompts.py out.jsonl [--num N] [--seed S]

The generators are word problems and exercises (arithmetic, fractions, equations, geometry, calendar and time,
logic). gsm_symbolic is left out on purpose: its templates are built from GSM8K *test* problems, one of the shipped
evaluation sets, so training on it would inflate `eval-draft --dataset gsm8k`. Half of the questions that set no
answer format of their own get the "reason step by step ... \\boxed{}" suffix of the DFlash authors' math prompts;
the rest stay bare (as MT-Bench asks)."""

from __future__ import annotations

import argparse
import random
import re

from blockspec.data.exclusion import write_training_prompts

GENERATORS = (
    "basic_arithmetic", "decimal_arithmetic", "complex_arithmetic", "fraction_simplification", "gcd", "lcm",
    "prime_factorization", "power_function", "base_conversion", "count_primes", "products", "chain_sum",
    "simple_equations", "polynomial_equations", "polynomial_multiplication", "simple_integration", "simple_geometry",
    "advanced_geometry", "calendar_arithmetic", "time_intervals", "leg_counting", "dice", "number_sequence",
    "family_relationships", "syllogism", "knights_knaves", "propositional_logic",
)
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
OWN_FORMAT = re.compile(r"answer|respond|give only|write out|round|format|in the form|only with", re.I)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--num", type=int, default=10000, help="prompts in all, spread evenly over the generators")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    try:
        import reasoning_gym
    except ImportError as e:
        raise SystemExit(f"reasoning-gym is not importable ({e}); see this script's docstring") from e
    rng = random.Random(a.seed)
    per = -(-a.num // len(GENERATORS))
    prompts: list[str] = []
    for i, name in enumerate(GENERATORS):
        ds = reasoning_gym.create_dataset(name, size=per, seed=a.seed * 1000 + i)
        prompts += [ds[j]["question"].strip() for j in range(per)]
    prompts = [q + SUFFIX if not OWN_FORMAT.search(q) and rng.random() < 0.5 else q
               for q in dict.fromkeys(prompts) if q]
    rng.shuffle(prompts)
    kept = write_training_prompts(a.out, prompts, a.num)
    print(f"wrote {min(a.num, len(kept.prompts))} prompts ({len(GENERATORS)} generators; "
          f"{kept.dropped()}) to {a.out}")


if __name__ == "__main__":
    main()
