"""Secrets out of everything sddoctor shows or stores: command lines and environment variables.

A name is secret when one of its words (split at `-`, `_`, `.`, `=` and camelCase) is a word
for a credential: token, key, secret, password, passwd, credential(s), apikey, auth, cookie,
and a few more. The value of such a name is replaced by `REDACTED`:

    --hub-token abc           ->  --hub-token REDACTED
    --api_key=abc             ->  --api_key=REDACTED
    --set wandb.api_key=abc   ->  --set wandb.api_key=REDACTED
    HF_TOKEN=abc (an env)     ->  HF_TOKEN=REDACTED
    https://user:pw@host/x    ->  https://user:REDACTED@host/x

The check is by word, not by substring, so NCCL_IB_PKEY, --max-tokens or --keep stay readable.
Stdlib only: the supervisor, the report, the TUI and check-nccl all use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

REDACTED = "REDACTED"

SECRET_WORDS = frozenset(
    {
        "token",
        "key",
        "secret",
        "secrets",
        "password",
        "passwd",
        "passphrase",
        "credential",
        "credentials",
        "apikey",
        "auth",
        "authorization",
        "cookie",
        "bearer",
        "accesskey",
        "secretkey",
        "privatekey",
        "authtoken",
    }
)

_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@")


def is_secret_name(name: str) -> bool:
    """Whether a variable or option name names a credential (see the module docstring)."""
    words = _WORDS.findall(name.lstrip("-"))
    return any(w.lower() in SECRET_WORDS for w in words)


def redact_text(text: str) -> str:
    """A password inside a URL (scheme://user:password@host) replaced."""
    if "@" not in text or "://" not in text:
        return text
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line with the values of secret options and assignments replaced."""
    out: list[str] = []
    hide_next = False
    for word in argv:
        word = str(word)
        if hide_next:
            hide_next = False
            if not word.startswith("-") or word == "-":
                out.append(REDACTED)
                continue
        name, eq, value = word.partition("=")
        if eq and value and is_secret_name(name) and " " not in name:
            out.append(f"{name}={REDACTED}")
            continue
        if word.startswith("-") and not eq and is_secret_name(word):
            hide_next = True  # `--token VALUE`: the next word is the value
        out.append(redact_text(word))
    return out


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Environment variables with secret values replaced (names stay, so their presence shows)."""
    return {k: (REDACTED if is_secret_name(k) and v else redact_text(str(v))) for k, v in env.items()}
