"""How the programs reach the layers below them: the dedicated programs reach the model layer through
`support_for` only, never a model module's internals, and every program checks its call through the one entry
point `check_program_call`, never the parts it is built of (the pipeline's `check_inputs`, the call's size)."""

import ast
from pathlib import Path

from diffusers_stepbatch import models

PROGRAMS = Path(__file__).parents[1] / "diffusers_stepbatch" / "programs"


def registers_a_program(path: Path) -> bool:
    return any(isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "register_program"
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
               for decorator in node.decorator_list)


PLANS = sorted(path for path in PROGRAMS.rglob("*.py") if registers_a_program(path))  # every program's planning
CHECK_PARTS = {"run_check_inputs", "check_call_size", "check_generic_call", "check_given_embeds_not_repeated",
               "check_latent_patches"}


def imports(path: Path) -> list[ast.ImportFrom]:
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)]


def test_dedicated_programs_import_no_model_module():
    model_modules = set(models.model_modules())
    for path in sorted((PROGRAMS / "dedicated").glob("*.py")):
        imported = {node.module.split(".")[1] for node in imports(path)
                    if node.module is not None and node.module.startswith("models.")}
        assert imported & model_modules == set(), (path.name, imported & model_modules)


def test_every_program_checks_its_call_through_one_entry_point():
    assert {path.name for path in PLANS} >= {"flux.py", "sd3.py", "qwenimage.py", "sdxl.py", "sd.py", "plan.py"}
    for path in PLANS:
        names = {alias.name for node in imports(path) for alias in node.names}
        calls = {node.func.id for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert "check_program_call" in names, path.name
        assert "check_program_call" in calls, path.name
        assert names & CHECK_PARTS == set(), (path.name, names & CHECK_PARTS)
