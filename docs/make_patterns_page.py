"""Writes docs/patterns.md from the preset files: python docs/make_patterns_page.py

Everything below the page's ``HAND_WRITTEN`` line is prose written by hand and kept as it is. The densities are the ones ``sparse-attn patterns`` prints (``sparse_attn.presets.preset_rows``).
"""
from pathlib import Path

import sparse_attn as sa
from sparse_attn.presets import preset_path, preset_rows

HAND_WRITTEN = "<!-- written by hand below this line; make_patterns_page.py keeps it -->"


def main() -> None:
    lines = ["# Pattern presets", "",
             "Presets are TOML files in [patterns/](../patterns/), shipped inside the wheel. Load one by name",
             "with `sa.preset(name)` (a name from `sa.list_presets()`, never a path), and write your own with",
             "`sa.save_pattern(pattern, path, description=...)` / read it with `sa.load_pattern(path)`.", "",
             "Densities are token densities (allowed pairs / N², whatever the block size) at 4,096 and 16,384",
             "tokens, as `sparse-attn patterns` prints them; `python docs/make_patterns_page.py` writes this",
             "page. Figures of each preset are in the [pattern gallery](gallery.md).", "",
             "| preset | pattern | description | density @4K | density @16K |", "|---|---|---|---:|---:|"]
    for name, description, _, d4, d16 in preset_rows():
        pattern = sa.preset(name)
        expression = repr(pattern) if len(repr(pattern)) < 90 else repr(pattern)[:87] + "..."
        lines.append(f"| `{name}` | `{expression.replace('|', chr(92) + '|')}` | {description} | {d4:.2%} | {d16:.2%} |")
    example = preset_path("streaming-llm").read_text().strip()
    lines += ["", "## File format", "", "```toml", example, "```", "",
              "`heads` is present for per-head patterns and checked when the file is loaded."]
    page = Path(__file__).parent / "patterns.md"
    old = page.read_text() if page.exists() else ""
    kept = old[old.index(HAND_WRITTEN):] if HAND_WRITTEN in old else HAND_WRITTEN + "\n"
    page.write_text("\n".join(lines) + "\n\n" + kept)


if __name__ == "__main__":
    main()
