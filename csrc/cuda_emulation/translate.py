"""Writes a .cu file of csrc/cuda/ as C++ for its CPU emulation (emulator.h), line for line.

Three rewrites, since these are CUDA syntax rather than names a header can define:
  kernel<<<grid, block[, shared[, stream]]>>>(args)
      ->  ::emu::launch("kernel", kernel, grid, block[, shared[, stream]])(args)
  extern __shared__ T name[];
      ->  T* name = static_cast<T*>(::emu::dynamic_shared_memory());
  __shared__ T a[...], b;   (a __shared__ variable is a static, emulator.h)
      ->  the same, then ::emu::poison_shared(&a, sizeof(a)); ::emu::poison_shared(&b, sizeof(b));
          on its last line, which poisons each once per block, as the dynamic shared memory is.
Comments and string literals are left alone. Each launch must sit on one line up to its "(", as in
csrc/cuda/. A #line directive keeps compiler messages pointing at the .cu file.

usage: python translate.py SOURCE.cu OUT.cpp
"""
import re
import sys

LAUNCH = re.compile(r"([\w:]+(?:<[^<>;()]*>)?)<<<(.*?)>>>\(")  # (a name, with its template arguments)
EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\[\];")
SHARED = re.compile(r"\b__shared__\b")


def blank_comments_and_strings(text: str) -> str:
    """text with its comments and string and character literals replaced by spaces (newlines kept), so
    that what is searched for is found in code only, at the same positions."""
    out, i, n = list(text), 0, len(text)
    while i < n:
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
        elif text[i] in "\"'":
            end = i + 1
            while end < n and text[end] != text[i]:
                end += 2 if text[end] == "\\" else 1
            end += 1
        else:
            i += 1
            continue
        for k in range(i, min(end, n)):
            if out[k] != "\n":
                out[k] = " "
        i = end
    return "".join(out)


def split_top_level(s: str) -> list[str]:
    """s split at its commas outside brackets of any kind."""
    parts, depth, start = [], 0, 0
    for k, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(s[start:k])
            start = k + 1
    return parts + [s[start:]]


def declared_name(declarator: str) -> str:
    """The variable a declarator declares: its last identifier before any array bounds."""
    m = re.search(r"(\w+)\s*(\[[^\]]*\]\s*)*$", declarator.strip())
    if m is None:
        sys.exit(f"translate.py: cannot find the variable in the __shared__ declaration {declarator.strip()!r}")
    return m.group(1)


def translate(text: str) -> str:
    code = blank_comments_and_strings(text)
    edits = []  # (start, end, replacement), on text's positions
    for m in EXTERN_SHARED.finditer(code):
        edits.append((m.start(), m.end(), f"{m.group(1)}* {m.group(2)} = "
                                          f"static_cast<{m.group(1)}*>(::emu::dynamic_shared_memory());"))
    extern_spans = [(a, b) for a, b, _ in edits]
    for m in SHARED.finditer(code):
        if any(a <= m.start() < b for a, b in extern_spans):
            continue
        end = code.find(";", m.end())
        depth = 0
        for k in range(m.end(), len(code)):  # the declaration's ";", outside braces (a union's body)
            depth += (code[k] == "{") - (code[k] == "}")
            if code[k] == ";" and depth == 0:
                end = k
                break
        body = code[m.end():end]
        if "{" in body:  # a struct or union: the declarators follow its last "}"
            body = body[body.rindex("}") + 1:]
        names = [declared_name(d) for d in split_top_level(body)]
        calls = "".join(f" ::emu::poison_shared(&{v}, sizeof({v}));" for v in names)
        edits.append((end + 1, end + 1, calls))
    for m in LAUNCH.finditer(code):
        edits.append((m.start(), m.end(), f'::emu::launch("{m.group(1)}", {m.group(1)}, {text[m.start(2):m.end(2)]})('))
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    left = blank_comments_and_strings(text)
    if "<<<" in left or re.search(r"extern\s+__shared__", left):
        sys.exit("translate.py: a kernel launch or dynamic shared array this script cannot rewrite")
    return text


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    source, out = sys.argv[1], sys.argv[2]
    with open(source, encoding="utf-8") as f:
        text = f.read()
    body = f'#line 1 "{source}"\n' + translate(text)
    with open(out, "w", encoding="utf-8") as f:
        f.write(body)


if __name__ == "__main__":
    main()
