"""The one error type for a refused layout, config or collective; the CLI prints it and exits 2."""

from __future__ import annotations


class ContractError(ValueError):
    """A rule of the contract failed. The message names the rule, the values, and a fix."""

    def __init__(self, rule: str, problem: str, fix: str) -> None:
        self.rule = rule
        self.problem = problem
        self.fix = fix
        super().__init__(f"[{rule}] {problem}\n  fix: {fix}")
