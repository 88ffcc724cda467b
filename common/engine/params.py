"""What a question may ask for: generation parameters and their limits (no torch: the wire
schemas validate questions against the same numbers)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_QUESTION_TOKENS = 2048
MAX_NEW_TOKENS = 2048
DEFAULT_MAX_TOKENS = 128
MAX_TEMPERATURE = 2.0
# Sampling divides float32 logits by the temperature and keeps tokens below top_p: a temperature
# under ~1e-38 makes that inf/NaN, a top_p under ~1e-45 is 0 (no token kept). So a positive value
# is at least this, where sampling is greedy (or keeps only the top token) already.
MIN_TEMPERATURE = 1e-6
MIN_TOP_P = 1e-6


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
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            bounds = f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
            raise QuestionError(f"temperature must be 0 (greedy) or in {bounds}, got {self.temperature}")
        if not MIN_TOP_P <= self.top_p <= 1.0:
            raise QuestionError(f"top_p must be in [{MIN_TOP_P:g}, 1], got {self.top_p}")
