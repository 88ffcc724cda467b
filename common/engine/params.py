"""What a question may ask for: generation parameters and their limits (no torch: the wire
schemas validate questions against the same numbers)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_QUESTION_TOKENS = 2048
MAX_NEW_TOKENS = 2048
DEFAULT_MAX_TOKENS = 128
MAX_TEMPERATURE = 2.0


class QuestionError(ValueError):
    """The question cannot be asked as given (empty, too long, bad parameters)."""


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= MAX_NEW_TOKENS:
            raise QuestionError(f"max_tokens must be in 1..{MAX_NEW_TOKENS}, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise QuestionError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise QuestionError(f"top_p must be in (0, 1], got {self.top_p}")
