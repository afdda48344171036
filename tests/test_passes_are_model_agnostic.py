"""The passes recognise meanings, not one model's or vendor's spelling: no model, family or vendor name in the
code of passes/ (identifiers and string literals; docstrings and comments may cite where a spelling was seen)."""

import ast
import re
from pathlib import Path

import pytest

PASSES = sorted((Path(__file__).resolve().parent.parent / "passes").glob("*.py"))
# Model families whose code dzc compiles, and the vendors its targets cover (profile fields carry those).
FORBIDDEN = re.compile(r"llama|qwen|gemma|mistral|mixtral|deepseek|gpt_?oss|phi\d|siglip|glm|kimi|minimax"
                       r"|cuda|musa|nvidia|moore|hopper|sm_?\d\d", re.IGNORECASE)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _code_words(tree: ast.AST):
    """(line, word) for every identifier and non-docstring string literal."""
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


@pytest.mark.parametrize("path", PASSES, ids=lambda p: p.name)
def test_pass_code_names_no_model_or_vendor(path):
    hits = [f"{path.name}:{line}: {word!r}" for line, word in _code_words(ast.parse(path.read_text()))
            if FORBIDDEN.search(word)]
    assert not hits, "\n".join(hits)


def test_the_check_sees_identifiers_and_strings_but_not_docstrings():
    tree = ast.parse('def f():\n    """Seen in Llama."""\n    x = "qwen_rope"\n    return _match_gptoss_glu(x)\n')
    assert [word for _, word in _code_words(tree) if FORBIDDEN.search(word)] == ["qwen_rope", "_match_gptoss_glu"]
