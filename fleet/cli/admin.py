"""``tidegate keys``, ``policy``, ``tenant`` and ``batches``: the commands on
control data in NATS KV, with their parsers and argument types."""

from __future__ import annotations

import argparse
from typing import Any

from fleet.cli.common import add_common, load_config


def checked_name(value: str) -> str:
    from tidegate.control.admin import name_problem

    problem = name_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def _limit(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = unlimited), got {number}")
    return number


def _models(value: str) -> tuple[str, ...]:
    from tidegate.control.admin import UsageError, parse_models

    try:
        return parse_models(value)
    except UsageError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated model names, got {value!r}") from None


def _key_id(value: str) -> str:
    value = value.strip().lower()
    if len(value) < 12 or any(c not in "0123456789abcdef" for c in value):
        raise argparse.ArgumentTypeError(
            f"a key id is the 12 hex characters `tidegate keys list` shows, got {value!r}")
    return value


def _duration(value: str) -> float:
    from tidegate.control.admin import UsageError, parse_duration

    try:
        return parse_duration(value)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def admin_parsers(sub: Any) -> None:
    keys = sub.add_parser("keys", help="create, list and revoke API keys",
                          description="API keys live hashed in the NATS KV bucket TG_KEYS; "
                                      "edges pick up changes within a second. See "
                                      "docs/keys-and-policies.md.")
    keys_sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (once)")
    add_common(create)
    create.add_argument("--tenant", required=True, type=checked_name,
                        help="tenant the key bills to")
    create.add_argument("--user", type=checked_name, help="user within the tenant (optional)")
    create.add_argument("--models", type=_models, default=(), metavar="A,B",
                        help="models the key may use (default: all)")
    create.add_argument("--json", action="store_true", help="print the key and record as JSON")
    create.add_argument("--expires", type=_duration, default=0.0, metavar="DURATION",
                        help="the key stops working after this long, e.g. 30d, 12h "
                             "(default: never)")
    create.add_argument("--admin", action="store_true",
                        help="an admin key: it may also sign in to the operator console "
                             "(`tidegate console`, docs/console.md)")
    rotate = keys_sub.add_parser(
        "rotate", help="replace a key: a new one now, the old one expires after --overlap")
    add_common(rotate)
    rotate.add_argument("key_id", metavar="KEY_ID", type=_key_id,
                        help="the key id shown by `keys create` / `keys list`")
    rotate.add_argument("--overlap", type=_duration, default=3600.0, metavar="DURATION",
                        help="how long the old key keeps working (default: 1h)")
    rotate.add_argument("--expires", type=_duration, default=0.0, metavar="DURATION",
                        help="the new key's lifetime (default: never)")
    rotate.add_argument("--json", action="store_true", help="print JSON")
    listing = keys_sub.add_parser("list", help="list keys (never the keys themselves)")
    add_common(listing)
    listing.add_argument("--json", action="store_true", help="print JSON")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its key id")
    add_common(revoke)
    revoke.add_argument("key_id", metavar="KEY_ID", type=_key_id,
                        help="the key id shown by `keys create` / `keys list`")

    policy = sub.add_parser("policy", help="set, list and delete quota policies",
                            description="Quota policies live in the NATS KV bucket "
                                        "TG_POLICIES; dispatchers pick up changes within a "
                                        "second. See docs/keys-and-policies.md.")
    policy_sub = policy.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    pset = policy_sub.add_parser(
        "set", help="set the limits of one scope (replacing its previous policy)",
        description="Scope: --tenant, --model, --tenant with --model, --tenant with --user. "
                    "Limits left out are unlimited; give at least one.")
    pdelete = policy_sub.add_parser("delete", help="delete the policy of one scope")
    for p in (pset, pdelete):
        add_common(p)
        # No string defaults: argparse would run them through the type check.
        p.add_argument("--tenant", type=checked_name, help="tenant (default: any)")
        p.add_argument("--model", type=checked_name, help="model (default: any)")
        p.add_argument("--user", type=checked_name, help="user of --tenant (default: any)")
    pset.add_argument("--rpm", type=_limit, metavar="N", help="requests per minute")
    pset.add_argument("--tpm", type=_limit, metavar="N", help="tokens per minute")
    pset.add_argument("--concurrency", type=_limit, metavar="N", help="concurrent streams")
    plist = policy_sub.add_parser("list", help="list policies")
    add_common(plist)
    plist.add_argument("--json", action="store_true", help="print JSON")
    _tenant_parsers(sub)


def _on_off(value: str) -> bool:
    v = value.strip().lower()
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return number


def _tenant_parsers(sub: Any) -> None:
    tenant = sub.add_parser("tenant", help="set, list and delete per-tenant settings",
                            description="Tenant settings (resumable streams) live in the NATS "
                                        "KV bucket TG_TENANTS; edges pick up changes within a "
                                        "second. See docs/resume.md.")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", metavar="ACTION", required=True)
    tset = tenant_sub.add_parser("set", help="set a tenant's settings (replacing them)")
    add_common(tset)
    tset.add_argument("tenant", metavar="TENANT", type=checked_name,
                      help="the tenant the settings are for")
    tset.add_argument("--resumable", type=_on_off, default=False, metavar="on|off",
                      help="every streaming request of the tenant is resumable "
                           "(default: off)")
    tset.add_argument("--grace", type=_seconds, metavar="SECONDS",
                      help="the tenant's resume grace (default: resume.grace)")
    tset.add_argument("--tier", default="", metavar="NAME",
                      help="a [[tiers]] name: the tenant's weight in queue mode "
                           "(default: its tier in the config, if any)")
    tdelete = tenant_sub.add_parser("delete", help="delete a tenant's settings")
    add_common(tdelete)
    tdelete.add_argument("tenant", metavar="TENANT", type=checked_name,
                         help="the tenant whose settings to delete")
    tlist = tenant_sub.add_parser("list", help="list tenant settings")
    add_common(tlist)
    tlist.add_argument("--json", action="store_true", help="print JSON")

    batches = sub.add_parser("batches", help="list, show and cancel batches",
                             description="Batches of every tenant, from the NATS KV bucket "
                                         "TG_BATCHES. See docs/batch.md.")
    batches_sub = batches.add_subparsers(dest="batches_command", metavar="ACTION",
                                         required=True)
    blist = batches_sub.add_parser("list", help="list batches, newest first")
    add_common(blist)
    blist.add_argument("--tenant", type=checked_name, help="only this tenant's")
    blist.add_argument("--status", help="only batches in this status (e.g. in_progress)")
    blist.add_argument("--json", action="store_true", help="print JSON")
    for action, text in (("show", "print one batch as JSON"),
                         ("cancel", "cancel a batch (as its tenant's API call would)")):
        p = batches_sub.add_parser(action, help=text)
        add_common(p)
        p.add_argument("batch_id", metavar="BATCH_ID", help="batch_...")


def _audit_to_stderr() -> None:
    """The CLI's changes leave the same audit line the console's do
    (tidegate.control.operations), on stderr: a command line has no log file."""
    import logging
    import sys

    audit = logging.getLogger("tidegate.audit")
    if not audit.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("tidegate: %(message)s"))
        audit.addHandler(handler)
        audit.setLevel(logging.INFO)
        audit.propagate = False


def cmd_keys(args: argparse.Namespace) -> int:
    from fleet.cli import keys as commands

    _audit_to_stderr()
    config = load_config(args)
    if args.keys_command == "create":
        return commands.keys_create(config, args.tenant, args.user or "", args.models,
                                    args.json, expires_in=args.expires, admin=args.admin)
    if args.keys_command == "list":
        return commands.keys_list(config, args.json)
    if args.keys_command == "rotate":
        return commands.keys_rotate(config, args.key_id, args.overlap, args.expires, args.json)
    return commands.keys_revoke(config, args.key_id)


def cmd_policy(args: argparse.Namespace) -> int:
    _audit_to_stderr()
    from fleet.cli import keys as commands

    config = load_config(args)
    if args.policy_command == "set":
        return commands.policy_set(config, args.tenant or "", args.model or "", args.user or "",
                                args.rpm, args.tpm, args.concurrency)
    if args.policy_command == "list":
        return commands.policy_list(config, args.json)
    return commands.policy_delete(config, args.tenant or "", args.model or "", args.user or "")


def cmd_batches(args: argparse.Namespace) -> int:
    _audit_to_stderr()
    from tidegate.control import batch_admin

    config = load_config(args)
    if args.batches_command == "list":
        return batch_admin.batches_list(config, args.json, args.tenant or "",
                                        args.status or "")
    if args.batches_command == "show":
        return batch_admin.batches_show(config, args.batch_id)
    return batch_admin.batches_cancel(config, args.batch_id)


def cmd_tenant(args: argparse.Namespace) -> int:
    _audit_to_stderr()
    from fleet.cli import tenants

    config = load_config(args)
    if args.tenant_command == "set":
        return tenants.cli_set(config, args.tenant, args.resumable, args.grace, args.tier)
    if args.tenant_command == "list":
        return tenants.cli_list(config, args.json)
    return tenants.cli_delete(config, args.tenant)
