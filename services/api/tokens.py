"""Manage the API's bearer tokens: `python -m services.api.tokens create NAME --scope submit|admin`, `list`,
`revoke NAME`.

`create` prints the token on stdout, alone, once (`TOKEN=$(python -m services.api.tokens create ci)`); only
its SHA-256 is stored, so it cannot be shown again. `list` never prints tokens. Exit status 1 when the name is
taken (create) or unknown (revoke), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys

from shared.auth.scopes import Scope
from shared.auth.tokens import TokenExists, TokenNotFound, create_token, list_tokens, revoke_token
from shared.db.engine import session_scope


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.api.tokens", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("create", help="add a token and print it (once)")
    create.add_argument("name", help="who or what holds it, e.g. ci or alice")
    create.add_argument(
        "--scope",
        type=Scope,
        choices=list(Scope),
        default=Scope.submit,
        help="submit: submit models and cancel jobs; admin: also force reruns and start sweeps (default: submit)",
    )
    commands.add_parser("list", help="names, scopes and dates; never the tokens")
    revoke = commands.add_parser("revoke", help="revoke a token by name: it is refused from the next request on")
    revoke.add_argument("name")
    args = parser.parse_args(argv)

    try:
        with session_scope() as session:
            if args.command == "create":
                print(create_token(session, args.name, args.scope))
                print(f"token {args.name!r} ({args.scope.value}) created; it is not shown again", file=sys.stderr)
            elif args.command == "list":
                print(f"{'name':<24} {'scope':<7} {'created (UTC)':<20} {'last used':<20} revoked")
                for t in list_tokens(session):
                    print(f"{t.name:<24} {t.scope.value:<7} {_when(t.created_at):<20} {_when(t.last_used_at):<20} "
                          f"{_when(t.revoked_at)}")  # fmt: skip
            else:
                token = revoke_token(session, args.name)
                print(f"token {token.name!r} revoked at {_when(token.revoked_at)}", file=sys.stderr)
    except (TokenExists, TokenNotFound) as exc:
        print(exc, file=sys.stderr)
        return 1
    except ValueError as exc:
        parser.error(str(exc))
    return 0


def _when(moment: dt.datetime | None) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S}" if moment is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
