"""Mark one symbol-version need of an ELF shared object weak, in place.

``python weaken_version_need.py FILE VERSION`` sets ``VER_FLG_WEAK`` on the
vernaux entry of ``.gnu.version_r`` that names VERSION, so the dynamic loader
no longer refuses a library whose version list stops before VERSION (the
symbols themselves still have to come from somewhere: scripts/vllm-env
preloads them). Idempotent; exits non-zero when FILE does not need VERSION.
Runs in the cached vLLM environment, which has pyelftools.
"""

from __future__ import annotations

import sys

from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

VER_FLG_WEAK = 0x2


def weaken(path: str, version: str) -> bool:
    """Return True if the entry was changed, False if it was weak already."""
    with open(path, "r+b") as f:
        elf = ELFFile(f)
        section = next((s for s in elf.iter_sections() if isinstance(s, GNUVerNeedSection)), None)
        if section is None:
            raise SystemExit(f"{path}: no .gnu.version_r section")
        strtab = elf.get_section(section["sh_link"])
        need_struct = elf.structs.Elf_Verneed
        aux_struct = elf.structs.Elf_Vernaux
        offset = section["sh_offset"]
        for _ in range(section.num_versions()):
            f.seek(offset)
            need = need_struct.parse_stream(f)
            aux_offset = offset + need["vn_aux"]
            for _ in range(need["vn_cnt"]):
                f.seek(aux_offset)
                aux = aux_struct.parse_stream(f)
                if strtab.get_string(aux["vna_name"]) == version:
                    if aux["vna_flags"] & VER_FLG_WEAK:
                        return False
                    aux["vna_flags"] |= VER_FLG_WEAK
                    f.seek(aux_offset)
                    f.write(aux_struct.build(aux))
                    return True
                aux_offset += aux["vna_next"]
            offset += need["vn_next"]
    raise SystemExit(f"{path}: needs no symbol version {version}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: weaken_version_need.py FILE VERSION")
    changed = weaken(sys.argv[1], sys.argv[2])
    print(f"{sys.argv[2]} in {sys.argv[1]}: {'marked weak' if changed else 'already weak'}")
