"""docs/SERVER.md's server flag table matches the flags mha_server defines (server/config/flags.cc): the same names, the
same defaults, nothing missing and nothing extra.

Usage: python3 tests/flags_doc_test.py MHA_SERVER_BIN docs/SERVER.md
"""

import re
import subprocess
import sys


def server_flags(binary):
    """{name: default} from `mha_server --helpfull`'s section for server/config/flags.cc (absl exits 1 after help)."""
    text = subprocess.run([binary, "--helpfull"], capture_output=True, text=True, timeout=60).stdout
    section = re.search(r"Flags from \S*server/config/flags\.cc:\n(.*?)(?:\n\n|\Z)", text, re.S)
    if section is None:
        sys.exit("no 'Flags from .../server/config/flags.cc' section in --helpfull output:\n" + text[:2000])
    flags = {}
    for name, default in re.findall(r"--(\w+) \(.*?\);\s+default: (.*?);", section.group(1), re.S):
        flags[name] = default.strip('"')
    return flags


def documented_flags(path):
    """{name: default} from the rows of the '### Server flags' table: | `--name` | `default` or empty | ... |"""
    text = open(path, encoding="utf-8").read()
    table = re.search(r"### Server flags\n(.*?)\n\n", text, re.S)
    if table is None:
        sys.exit(f"{path} has no '### Server flags' table")
    flags = {}
    for row in table.group(1).splitlines():
        m = re.match(r"\| `--(\w+)` \|\s*`?([^`|]*?)`?\s*\|", row)
        if m:
            flags[m.group(1)] = m.group(2).strip()
    return flags


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: python3 tests/flags_doc_test.py MHA_SERVER_BIN docs/SERVER.md")
    binary, doc = sys.argv[1], sys.argv[2]
    have, documented = server_flags(binary), documented_flags(doc)
    failures = []
    for name in sorted(set(have) - set(documented)):
        failures.append(f"--{name} (default {have[name]!r}) is missing from {doc}'s flag table")
    for name in sorted(set(documented) - set(have)):
        failures.append(f"{doc} documents --{name}, which mha_server does not define")
    for name in sorted(set(have) & set(documented)):
        if have[name] != documented[name]:
            failures.append(f"--{name}: {doc} says default {documented[name]!r}, mha_server {have[name]!r}")
    for f in failures:
        print("FAIL:", f)
    print(f"flags: {len(have)} defined, {len(failures)} mismatched")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
