"""How one request wants its tokens chosen: the vLLM `SamplingParams` surface.

Validation lives here so that the offline API and the HTTP server reject bad
values with the same message, naming the field, before anything reaches the
engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

_GREEDY_EPS = 1e-5
# JSON as models mostly saw it in training (`json.dumps`' separators), with no free whitespace: a small
# model offered "any whitespace" can loop on newlines forever inside an otherwise valid object
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keywords whose value is one schema, a list of schemas, or a map of name -> schema (JSON Schema 2020-12 and
# draft 7); a schema that uses any of _OPEN_KEYS says itself what other properties it allows, or takes its
# properties from a composition that a closed sibling would contradict.
_ONE_SCHEMA = ("items", "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else",
               "propertyNames", "additionalProperties", "unevaluatedProperties")
_SCHEMA_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
              "$ref", "if", "dependentSchemas", "dependencies")


def close_objects(schema, top: bool = True):
    """`schema` with every object that lists its `properties` and says nothing about others closed
    (`"additionalProperties": false`), as vLLM's default grammar backend (xgrammar's strict mode) and
    OpenAI's `strict: true` treat them: under JSON Schema's own default (open objects) a small model
    constrained to a schema keeps inventing keys until max_tokens. A closed object is always valid under
    the open schema, so this only narrows what may be generated. Left as given: an object that states
    `additionalProperties` (or patternProperties, unevaluatedProperties) itself, one whose properties also
    come from allOf/anyOf/oneOf/$ref/if beside them, the several members of an `allOf` (each holds part of
    the properties), and `{"type": "object"}` without `properties` (any object). Returns a copy."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAP and isinstance(value, dict):
            out[key] = {name: close_objects(s) for name, s in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [close_objects(s, top=len(value) == 1) for s in value]
        elif key in _ONE_SCHEMA or (key in _SCHEMA_LIST and isinstance(value, list)):
            out[key] = close_objects(value)
        else:
            out[key] = value
    if top and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output to a grammar (vLLM's `StructuredOutputsParams`): exactly one of a
    JSON schema, any JSON object, a regular expression, a choice of strings, or a Lark grammar
    (llguidance's dialect). Checked here, so a malformed schema fails where the request is made,
    with the grammar library's own message; the engine compiles it into a token matcher
    (`conveyor/engine/structured_output.py`)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    spec: str = field(init=False, repr=False, compare=False, default="")  # the llguidance grammar

    def __post_init__(self) -> None:
        kinds = self._kinds()
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar or json_object, "
                             f"got {kinds or 'none'}")
        object.__setattr__(self, "spec", self._grammar(kinds[0]))
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(self.spec)
        if error:
            raise ValueError(f"structured_outputs: invalid {kinds[0]}: {error.strip()}")

    def _kinds(self) -> list[str]:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        return kinds + (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        return self._kinds()[0]

    def _grammar(self, kind: str) -> str:
        from llguidance import LLMatcher

        if kind in ("json", "json_object"):
            from conveyor.config import json_object

            what = "structured_outputs: the JSON schema"
            schema = {"type": "object"} if kind == "json_object" else close_objects(json_object(self.json, what))
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if kind == "regex":
            if not isinstance(self.regex, str):
                raise ValueError("structured_outputs: regex must be a string")
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs: choice must be a non-empty list of non-empty strings")
            # Lark string literals take JSON's escapes, so any choice (quotes, backslashes) is exact
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise ValueError("structured_outputs: grammar must be a non-empty Lark grammar")
        return LLMatcher.grammar_from_lark(self.grammar)


class ParamError(ValueError):
    """A bad request parameter: `param` names it (OpenAI's error `param`), and the message starts with it."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param} {why}")
        self.param = param


@dataclass
class SamplingParams:
    """Per-request sampling settings (names and meanings follow vLLM / OpenAI)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (0: only the sampled one)
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt token (vLLM); the first gets None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100..100)
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice or grammar
    stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ParamError:
            return ParamError(name, why)

        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            finite(name, getattr(self, name))
        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            raise bad("n", f"must be an integer in [1, 128], got {self.n!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            raise bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop_list) > 16:
            raise bad("stop", "may hold at most 16 strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > 300:
                raise bad("logit_bias", "must map at most 300 token ids to biases")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise bad("logit_bias", f"keys must be token ids (non-negative integers), got {t!r}")
                finite("logit_bias", b)
                if not -100 <= b <= 100:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {b}")

        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ParamError if `logit_bias` names a token the model does not have: the one check, made by
        the HTTP side (a 400) and by the engine (offline callers), which both know `vocab_size`."""
        if self.logit_bias and any(t >= vocab_size for t in self.logit_bias):
            raise ParamError("logit_bias", f"keys must be token ids in [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_sample(self, index: int) -> SamplingParams:
        """The params of the `index`-th of `n` samples: n=1, and a distinct seed so samples differ."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
