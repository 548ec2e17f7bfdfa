"""The kernel's code (outside its built-in echo plugin and its test support) names nothing that belongs to one
plugin: no placement plugin's settings, no model family's phases or trace keys. Docstrings and comments may
mention them as examples; identifiers and string literals may not."""

from __future__ import annotations

import ast
import re
from pathlib import Path

KERNEL = Path(__file__).resolve().parents[1] / "omni_kernel"
EXEMPT = {"builtin", "testing.py"}
FORBIDDEN = re.compile(r"\bray\b|replica|worker_threads|restart|omni-workers|omni_workers|denois|export|^ar\.|"
                       r"^diffusion\.|\bwan\b|qwen", re.IGNORECASE)


def kernel_files() -> list[Path]:
    return [p for p in KERNEL.rglob("*.py") if not EXEMPT & {p.relative_to(KERNEL).parts[0]}]


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def words(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every identifier and non-docstring string literal in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.lineno, node.name))
        elif isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
    return found


def test_the_kernel_names_no_one_plugin_word():
    hits = [f"{path.relative_to(KERNEL)}:{line}: {text!r}" for path in kernel_files()
            for line, text in words(path) if FORBIDDEN.search(text)]
    assert hits == []


def test_the_check_finds_a_forbidden_word(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Docstrings may say replicas."""\nmax_restarts = 1\nkey = "ar.ttft_ms"\n', encoding="utf-8")
    assert [text for _, text in words(sample) if FORBIDDEN.search(text)] == ["max_restarts", "ar.ttft_ms"]


# StageStats is what every stage reports: a field of one plugin's (a model family's counter, a placement's restarts)
# belongs in its open slots, `model` and `placed`, not beside these.
STAGE_STATS_FIELDS = ("running", "waiting", "kv_blocks_total", "kv_blocks_used", "prefix_hit_tokens", "dead", "model",
                      "placed")


def test_stage_stats_has_only_the_kernels_fields():
    import attrs

    from omni_kernel.core.request import StageStats

    assert tuple(f.name for f in attrs.fields(StageStats)) == STAGE_STATS_FIELDS
