#!/usr/bin/python3
"""Writes docs/API.md from proto/mha/v1/attention.proto's comments: the file's conventions, the service's rpcs, and
every message and enum with its fields and their comments, in file order.

Usage: gen_api_doc.py PROTO OUT.md           write OUT.md
       gen_api_doc.py PROTO OUT.md --check   exit 1 (and say so) when OUT.md is not what PROTO makes (ctest runs
                                             this, so the doc cannot fall behind the contract)

Reads the subset of proto3 the file uses: top-level messages (with nested oneofs), enums and one service; leading
`//` comment blocks and trailing `//` comments, continued on following comment-only lines aligned with them.
"""
import re
import sys

FIELD = re.compile(r"^((?:repeated|optional)\s+)?([\w.]+)\s+(\w+)\s*=\s*(\d+);")
ENUM_VALUE = re.compile(r"^(\w+)\s*=\s*(-?\d+);")
RPC = re.compile(r"^rpc\s+(\w+)\(((?:stream\s+)?\w+)\)\s+returns\s+\(((?:stream\s+)?\w+)\);")


def link(type_name):
    """A message type as a link to its section; a streamed one as "stream <link>"."""
    words = type_name.split()
    return " ".join(words[:-1] + [f"[{words[-1]}](#{words[-1].lower()})"])


def parse(text):
    """[(kind, name, doc, members)] for messages, enums and the service; members are dicts with a doc each."""
    lines = text.splitlines()
    blocks, pending, stack = [], [], []
    header = []
    i = 0
    # The file's leading comment block (before `syntax`) is its overview.
    while i < len(lines) and lines[i].startswith("//"):
        header.append(lines[i][2:].strip() if len(lines[i]) > 2 else "")
        i += 1
    last = None  # the member or block the previous line's trailing comment belongs to
    for raw in lines[i:]:
        line = raw.strip()
        if line.startswith("//"):
            comment = line[2:].strip()
            # A comment-only line aligned with the previous line's trailing comment continues it; any other
            # comment-only line leads the next declaration.
            if last is not None and last.get("continues") and raw.find("//") == last.get("column"):
                last["doc"] += " " + comment
            else:
                pending.append(comment)
            continue
        code, _, trailing = line.partition("//")
        code, trailing = code.strip(), trailing.strip()
        if last is not None:
            last["continues"] = False
        opened = re.match(r"^(message|enum|service|oneof)\s+(\w+)\s*\{", code)
        if opened:
            kind, name = opened.groups()
            block = {"kind": kind, "name": name, "doc": " ".join(pending), "members": []}
            pending = []
            if kind == "oneof" and stack:
                block["oneof"] = True
                stack.append(block)  # its fields go to the enclosing message, marked with the oneof's name
            else:
                blocks.append(block)
                stack.append(block)
            last = None
            continue
        if code.startswith("}"):
            if stack:
                stack.pop()
            pending, last = [], None
            continue
        target = next((b for b in reversed(stack) if not b.get("oneof")), None)
        oneof = stack[-1]["name"] if stack and stack[-1].get("oneof") else None
        member = None
        if (m := FIELD.match(code)) and target is not None and target["kind"] == "message":
            repeated, ftype, name, number = m.groups()
            member = {"name": name, "type": (repeated.strip() + " " if repeated else "") + ftype, "number": number, "oneof": oneof}
        elif (m := ENUM_VALUE.match(code)) and target is not None and target["kind"] == "enum":
            member = {"name": m.group(1), "number": m.group(2)}
        elif (m := RPC.match(code)) and target is not None and target["kind"] == "service":
            member = {"name": m.group(1), "request": m.group(2), "response": m.group(3)}
        if member is not None:
            docs = [d for d in (" ".join(pending), trailing) if d]
            member["doc"] = " ".join(docs)
            member["continues"] = bool(trailing)
            member["column"] = raw.find("//")
            target["members"].append(member)
            last = member
        pending = []
    return header, blocks


def cell(text):
    return text.replace("|", "\\|")


def render(header, blocks, source):
    out = ["# mha.v1 API", "",
           f"Generated from `{source}` by `proto/gen_api_doc.py`; do not edit (ctest's `api_doc` checks it is current).",
           ""]
    out += ["## Conventions", "", "\n".join(header).strip(), ""]
    for block in blocks:
        if block["kind"] == "service":
            out += [f"## service {block['name']}", "", block["doc"], "", "| rpc | request | response | what |",
                    "| --- | --- | --- | --- |"]
            out += [f"| `{m['name']}` | {link(m['request'])} | {link(m['response'])} | {cell(m['doc'])} |"
                    for m in block["members"]]
            out.append("")
    for block in blocks:
        if block["kind"] == "message":
            out += [f"## {block['name']}", ""]
            if block["doc"]:
                out += [block["doc"], ""]
            if block["members"]:
                out += ["| field | type | # | meaning |", "| --- | --- | --- | --- |"]
                for m in block["members"]:
                    note = f" (oneof `{m['oneof']}`)" if m["oneof"] else ""
                    out.append(f"| `{m['name']}`{note} | `{m['type']}` | {m['number']} | {cell(m['doc'])} |")
                out.append("")
        elif block["kind"] == "enum":
            out += [f"## enum {block['name']}", ""]
            if block["doc"]:
                out += [block["doc"], ""]
            out += ["| value | # | meaning |", "| --- | --- | --- |"]
            out += [f"| `{m['name']}` | {m['number']} | {cell(m['doc'])} |" for m in block["members"]]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def main():
    if len(sys.argv) not in (3, 4) or (len(sys.argv) == 4 and sys.argv[3] != "--check"):
        sys.exit(__doc__)
    proto, out = sys.argv[1], sys.argv[2]
    with open(proto) as f:
        header, blocks = parse(f.read())
    text = render(header, blocks, "proto/mha/v1/attention.proto")
    if len(sys.argv) == 4:
        try:
            with open(out) as f:
                current = f.read()
        except OSError:
            current = None
        if current != text:
            sys.exit(f"{out} is out of date with {proto}: run proto/gen_api_doc.py {proto} {out}")
        print(f"api_doc: {out} is current ({sum(len(b['members']) for b in blocks)} members in {len(blocks)} blocks)")
        return
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
