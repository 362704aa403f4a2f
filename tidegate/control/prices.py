"""Prices per model and the cost of a request.

A :class:`Price` is what one model costs in ``spend.currency``: per million
input, cached input and output tokens, and per request. Prices come from the
config (``models[].price_*``) and from the ``<P>_PRICES`` bucket (``tidegate
price set``), which wins per model and is watched, so a change applies to the
next request without a restart.

Invariant: money is counted in integer nano-units (10^-9 of the currency),
exact in Redis and in the quota scripts (never a Lua double); a request's cost
is rounded half up once, from exact decimals. Docs: docs/spend.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tidegate.broker.broker import ensure_bucket
from tidegate.broker.kvwatch import follow_bucket, snapshot
from tidegate.config import Config, ModelConfig
from tidegate.errors import ProtocolError
from tidegate.wire.subjects import decode_token, encode_token

log = logging.getLogger("tidegate.prices")

NANO = 10**9  # nano-units per currency unit
_MILLION = Decimal(1_000_000)
# The largest price accepted (per million tokens or per request): keeps every
# cost a request can reach (2^18 output tokens x n) far below Redis's 2^63.
MAX_PRICE = Decimal(1_000_000)
_FIELDS = ("input", "cached_input", "output", "request")


def bucket_name(config: Config) -> str:
    return f"{config.nats.subjects.prefix.upper()}_PRICES"


def parse_amount(value: Any, what: str) -> Decimal:
    """A price or budget amount: a finite decimal >= 0 (a string or a number).
    Raises ``ValueError`` with a readable message."""
    if isinstance(value, bool) or not isinstance(value, str | int | float | Decimal):
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return amount


def to_nanos(amount: Decimal) -> int:
    """Currency units -> nano-units, rounded half up."""
    return int((amount * NANO).to_integral_value(ROUND_HALF_UP))


def format_money(nanos: int) -> str:
    """Nano-units as a plain decimal string without trailing zeros: ``0.000123``."""
    text = f"{Decimal(nanos).scaleb(-9):f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


@dataclass(frozen=True, slots=True)
class Price:
    """What one model costs: per million input / cached input / output tokens,
    and per request. ``cached_input`` None = the input price."""

    model: str
    input: Decimal = Decimal(0)
    cached_input: Decimal | None = None
    output: Decimal = Decimal(0)
    request: Decimal = Decimal(0)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("a price needs a model")
        for name in _FIELDS:
            value = getattr(self, name)
            if value is None and name == "cached_input":
                continue
            amount = parse_amount(value, name)
            if amount > MAX_PRICE:
                raise ValueError(f"{name} must be at most {MAX_PRICE}, got {value!r}")
            object.__setattr__(self, name, amount)

    @property
    def cached(self) -> Decimal:
        return self.input if self.cached_input is None else self.cached_input

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             requests: int = 1) -> int:
        """The cost in nano-units. Cached tokens are part of ``prompt_tokens``
        (as OpenAI reports them) and are charged at the cached price."""
        prompt = max(prompt_tokens, 0)
        cached = min(max(cached_tokens, 0), prompt)
        per_token = ((prompt - cached) * self.input + cached * self.cached
                     + max(completion_tokens, 0) * self.output) / _MILLION
        return to_nanos(per_token + requests * self.request)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "input": str(self.input),
                "cached_input": None if self.cached_input is None else str(self.cached_input),
                "output": str(self.output), "request": str(self.request)}

    def encode(self) -> bytes:
        return json.dumps(self.as_dict(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Price:
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict):
                raise TypeError("not an object")
            unknown = set(raw) - {"model", *_FIELDS}
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)}")
            return cls(**raw)
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"malformed price: {exc}") from None

    @classmethod
    def from_model(cls, model: ModelConfig) -> Price | None:
        """The config's price of a model, or None when it sets none."""
        values = (model.price_input, model.price_cached_input, model.price_output,
                  model.price_request)
        if not any(v > 0 for v in values):
            return None
        return cls(model.name, Decimal(str(model.price_input)),
                   None if model.price_cached_input < 0 else
                   Decimal(str(model.price_cached_input)),
                   Decimal(str(model.price_output)), Decimal(str(model.price_request)))


class PriceBook:
    """The prices in force (sans-I/O): the config's, overridden per model by
    the KV bucket's. Looked up by a model's name (aliases resolve to it)."""

    def __init__(self, config: Config) -> None:
        self.currency = config.spend.currency
        self._configured: dict[str, Price] = {}
        for model in config.models:
            price = Price.from_model(model)
            if price is not None:
                self._configured[model.name] = price
        self._stored: dict[str, Price] = {}

    def get(self, model: str) -> Price | None:
        return self._stored.get(model) or self._configured.get(model)

    def put(self, price: Price) -> None:
        self._stored[price.model] = price

    def for_job(self, model: str, extra: dict[str, Any]) -> tuple[Price | None, dict[str, Any]]:
        """A job's price, taken once when it starts (its record, its Done and
        its usage chunk then agree even if the price changes mid-stream), and
        its ``Request.extra``, with the price spec for the usage chunk's
        extension when the client asked for it (:data:`COST_OPT_IN`)."""
        price = self.get(model)
        if price is None or not extra.get(COST_OPT_IN):
            return price, extra
        return price, {**extra, PRICE_EXTRA: price_spec(price, self.currency)}

    def apply(self, key: str, value: bytes) -> None:
        """A KV entry: ``key`` is the model's token, ``value`` its price."""
        try:
            price = Price.decode(value)
            if encode_token(price.model) != key:
                raise ProtocolError(f"price of {price.model!r} stored under {key}")
        except (ProtocolError, ValueError) as exc:
            log.error("ignoring price %s: %s", key, exc)
            return
        self._stored[price.model] = price

    def remove(self, key: str) -> None:
        try:
            self._stored.pop(decode_token(key), None)
        except ValueError:
            pass


# --------------------------------------------------------------------------
# KV
# --------------------------------------------------------------------------


async def ensure_prices_bucket(js: JetStreamContext, config: Config) -> KeyValue:
    return await ensure_bucket(js, config, bucket_name(config), "tidegate: prices per model")


async def watch_prices(kv: KeyValue, book: PriceBook, *,
                       on_synced: Callable[[], None] | None = None) -> None:
    """Keep ``book`` equal to the bucket (over the config's prices). Runs until cancelled."""
    await follow_bucket(kv, book.apply, book.remove, on_synced=on_synced)


async def set_price(kv: KeyValue, price: Price) -> None:
    await kv.put(encode_token(price.model), price.encode())


async def delete_price(kv: KeyValue, model: str) -> bool:
    try:
        await kv.get(encode_token(model))
    except nats.js.errors.KeyNotFoundError:
        return False
    await kv.delete(encode_token(model))
    return True


async def list_prices(kv: KeyValue) -> list[Price]:
    out = []
    for key, value in (await snapshot(kv)).items():
        try:
            out.append(Price.decode(value))
        except ProtocolError as exc:
            log.warning("skipping price %s: %s", key, exc)
    return sorted(out, key=lambda p: p.model)


# --------------------------------------------------------------------------
# The usage chunk's extension (opt-in per request)
# --------------------------------------------------------------------------

# Request.extra flag the edge sets when the client sent ``x-tidegate-cost:
# include``: the final usage chunk then carries the cost.
COST_OPT_IN = "cost"
# Request.extra entry the worker sets for the backend stream of an opted-in
# request: the price (Price.as_dict) and the currency.
PRICE_EXTRA = "price"


def job_cost(price: Price | None, outcome: str, prompt_tokens: int, completion_tokens: int,
             cached_tokens: int) -> int:
    """What a job cost in nano-units: nothing without a price, when it did not
    run (``dropped``) or its backend produced nothing (refused, unreachable,
    cancelled before its first token); else its usage at the price, the
    per-request price included. A cancelled stream pays its partial usage."""
    if price is None or outcome == "dropped" or (outcome != "done" and not completion_tokens):
        return 0
    return price.cost(prompt_tokens, completion_tokens, cached_tokens)


def price_spec(price: Price, currency: str) -> dict[str, Any]:
    return {**price.as_dict(), "currency": currency}


def cost_member(spec: Any, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int) -> bytes:
    """``,"x_tidegate":{"cost":"...","currency":"..."}``: the extension member
    of the final usage chunk, from a :func:`price_spec`; b"" when ``spec`` is
    not one. An extra top-level member, which OpenAI clients ignore."""
    if not isinstance(spec, dict):
        return b""
    try:
        currency = spec["currency"]
        price = Price(**{k: v for k, v in spec.items() if k != "currency"})
    except (KeyError, TypeError, ValueError):
        return b""
    cost = format_money(price.cost(prompt_tokens, completion_tokens, cached_tokens))
    return b',"x_tidegate":' + json.dumps({"cost": cost, "currency": currency},
                                          separators=(",", ":")).encode()
