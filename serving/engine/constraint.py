"""One sequence's place in its grammar (docs/architecture.md, "Structured outputs").

The invariant: a sequence's matcher has consumed exactly its output tokens, in order. The scheduler
advances it as it appends each sampled token (scheduler.py, update), and nothing else ever changes a
sequence's output tokens: a preempted sequence keeps them and recomputes their keys and values, so its
matcher stays where it was. Each of a request's `n` choices is a sequence of its own, with its own.

Imports no torch (the scheduler's policy modules must not); the masks are applied to logits in
grammar_mask.py.
"""

from __future__ import annotations

from llguidance import LLMatcher

from serving.engine.grammar import Grammar


class Constraint:
    __slots__ = ("error", "grammar", "matcher", "num_consumed")

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.matcher: LLMatcher = grammar.new_matcher()
        self.num_consumed = 0
        self.error: str | None = None  # why the last token was refused; the sequence ends in an error

    def advance(self, token_id: int) -> bool:
        """Consume a sampled token; False when the grammar refused it (a masked token was sampled, which
        the masks make impossible short of a bug), and the matcher is then stuck."""
        self.num_consumed += 1
        if self.matcher.consume_token(token_id):
            return True
        self.error = self.matcher.get_error() or f"token {token_id} is not allowed by the grammar"
        return False

    @property
    def is_complete(self) -> bool:
        """The output is a whole value of the grammar and nothing may follow it (but an end of
        sequence): the sequence finishes now, with "stop", rather than spend a step sampling EOS."""
        return self.matcher.is_stopped() and self.matcher.is_accepting() and not self.matcher.is_error()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` consumed, for a caller that drops output tokens (none does
        today: preemption keeps them)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_consumed -= num_tokens
