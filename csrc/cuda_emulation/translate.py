"""Writes a .cu file of csrc/cuda/ as C++ for its CPU emulation (emulator.h), line for line.

Two constructs are CUDA syntax rather than names a header can define:
  kernel<<<grid, block, shared, stream>>>(args)  ->  ::emu::launch("kernel", kernel, grid, block, shared, stream)(args)
  extern __shared__ T name[];                    ->  T* name = static_cast<T*>(::emu::dynamic_shared_memory());
Each launch must sit on one line up to its "(", as in csrc/cuda/. And each __shared__ variable (a
static, emulator.h) is followed, on its last line, by ::emu::poison_shared(&name, sizeof(name)), which
poisons it once per block, as the dynamic shared memory is. A #line directive keeps
compiler messages pointing at the .cu file.

usage: python translate.py SOURCE.cu OUT.cpp
"""
import re
import sys

LAUNCH = re.compile(r"(\S+)<<<(.*?)>>>\(")
EXTERN_SHARED = re.compile(r"extern __shared__ (\w+) (\w+)\[\];")


def poison_shared_variables(text: str) -> str:
    """After each `__shared__ ... name[...]...;` (braces and all: a union's body), the poisoning call."""
    out, pos = [], 0
    for m in re.finditer(r"\b__shared__\b", text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        if m.start() < pos or "//" in text[line_start:m.start()]:  # (a comment's word)
            continue
        depth, end = 0, m.end()
        while not (text[end] == ";" and depth == 0):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        declarator = re.sub(r"(\[[^\]]*\])+\s*$", "", text[m.end():end].rstrip())
        name = re.search(r"(\w+)$", declarator).group(1)
        out.append(text[pos:end + 1] + f" ::emu::poison_shared(&{name}, sizeof({name}));")
        pos = end + 1
    return "".join(out) + text[pos:]


def translate(text: str) -> str:
    text = EXTERN_SHARED.sub(r"\1* \2 = static_cast<\1*>(::emu::dynamic_shared_memory());", text)
    text = poison_shared_variables(text)
    text = LAUNCH.sub(lambda m: f'::emu::launch("{m.group(1)}", {m.group(1)}, {m.group(2)})(', text)
    if "<<<" in text or "__shared__ extern" in text or re.search(r"extern\s+__shared__", text):
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
