"""`kvfold doctor`: the real report on this machine, and the judgement of facts handed in (a
missing compiler, a failing tiny model, missing extras) without touching the cached native library."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvfold import cli, doctor

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def facts():
    return doctor.gather_facts()


def with_native(facts, **changes):
    out = copy.deepcopy(facts)
    out["native"].update(changes)
    return out


def test_doctor_runs_here_and_exits_0(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for section in ("cpu:", "native:", "torch:", "memory:", "models:", "tiny:", "extras:"):
        assert section in out
    assert "DeepSeek-V4-Flash" in out and "GLM-5.3-Flash" in out and out.rstrip().endswith("(exit 0)")


def test_json_has_every_key(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"kvfold", "cpu", "native", "torch", "memory", "models", "extras", "tiny", "problems", "can_serve",
            "exit_status"} <= set(report)
    assert report["can_serve"] is True and report["exit_status"] == 0 and report["tiny"]["ok"] is True
    assert {"model", "flags", "usable_cpus", "torch_threads", "serve_threads"} <= set(report["cpu"])
    assert {"avx2", "avx512f", "avx512_bf16", "amx_tile"} <= set(report["cpu"]["flags"])
    assert {"enabled", "isa_setting", "compiler", "loaded", "build", "library"} <= set(report["native"])
    assert report["native"]["loaded"] and report["native"]["build"]["path"] in ("AVX-512", "AVX2", "portable C")
    assert {"version", "build", "cuda_available", "devices", "triton"} <= set(report["torch"])
    assert set(report["extras"]) == {"structured", "bench", "gpu"}
    assert [m["name"] for m in report["models"]] == ["DeepSeek-V4-Flash", "GLM-5.3-Flash"]
    for m in report["models"]:
        assert m["weight_bytes"] > 100 * 2 ** 30 and m["state_bytes_per_sequence"] > 0
    for p in report["problems"]:
        assert set(p) == {"severity", "problem", "fix"}


def test_released_sizes_are_kvfold_plans_numbers(facts):
    from kvfold.plan import plan
    v4 = json.loads((ROOT / "tests" / "data" / "deepseek_v4_flash_config.json").read_text())
    _, params, ranks = plan(v4, weights="fp4", max_seq_len=doctor.SEQUENCE_TOKENS)
    assert facts["models"][0]["weight_bytes"] == ranks[0].weight_bytes and facts["models"][0]["parameters"] == params


def test_a_missing_compiler_names_its_fix_and_fails(facts):
    broken = with_native(facts, compiler=None, compiler_found=False, build=None, loaded=False, library=None,
                         error="no C compiler (cc/gcc) on PATH")
    problems = doctor.find_problems(broken)
    assert problems[0].severity == "error" and "no C compiler" in problems[0].problem
    assert "apt-get install gcc" in problems[0].fix
    assert doctor.exit_status(problems) == 1
    text = doctor.render_text(broken, problems)
    assert "fix: apt-get install gcc" in text and "NOT loaded" in text and text.rstrip().endswith("(exit 1)")
    assert doctor.report_json(broken, problems)["can_serve"] is False


def test_a_compiler_that_is_not_there_and_one_that_fails_are_told_apart(facts):
    gone = doctor.find_problems(with_native(facts, compiler="/nonexistent", compiler_found=False, loaded=False))
    assert "CC=/nonexistent" in gone[0].problem and "point CC at a C compiler" in gone[0].fix
    failing = doctor.find_problems(with_native(facts, loaded=False, error="undefined reference to omp_get_num_threads"))
    assert "undefined reference" in failing[0].problem and "libgomp" in failing[0].fix
    for problems in (gone, failing):
        assert doctor.exit_status(problems) == 1


def test_kernels_turned_off_on_purpose_warn_without_failing(facts):
    problems = doctor.find_problems(with_native(facts, enabled=False, loaded=False))
    assert [p.severity for p in problems if "KVFOLD_NATIVE" in p.problem] == ["warning"]
    assert doctor.exit_status(problems) == 0


def test_a_tiny_model_that_does_not_run_fails(facts):
    broken = copy.deepcopy(facts)
    broken["tiny"] = {"ok": False, "seconds": 0.1, "error": "CheckpointError: missing 3", "batch_invariant": None}
    problems = doctor.find_problems(broken)
    assert problems[0].severity == "error" and "CheckpointError" in problems[0].problem
    assert "FAILED" in doctor.render_text(broken, problems) and doctor.exit_status(problems) == 1


def test_missing_extras_are_notes_with_their_pip_command(facts):
    lacking = copy.deepcopy(facts)
    lacking["extras"]["structured"]["xgrammar"] = None
    lacking["extras"]["gpu"]["triton"] = None
    notes = [p for p in doctor.find_problems(lacking) if p.fix.startswith("pip install 'kvfold[")]
    assert {p.fix for p in notes} >= {"pip install 'kvfold[structured]'", "pip install 'kvfold[gpu]'"}
    assert all(p.severity == "note" for p in notes)
    assert "xgrammar missing" in doctor.render_text(lacking, doctor.find_problems(lacking))


def test_a_cuda_machine_without_triton_is_told_to_install_the_gpu_extra(facts):
    gpu = copy.deepcopy(facts)
    gpu["torch"].update(build="CUDA 12.4", cuda_available=True, triton=None,
                        devices=[{"name": "H100", "memory_bytes": 80 << 30, "capability": "9.0"}])
    problems = doctor.find_problems(gpu)
    assert any(p.fix == "pip install 'kvfold[gpu]'" and p.severity == "warning" for p in problems)
    assert "cuda:0 H100 (80.00 GiB, sm 9.0)" in doctor.render_text(gpu, problems)


def test_models_that_do_not_fit_say_how_to_size_them(facts):
    small = copy.deepcopy(facts)
    small["memory"]["available_bytes"] = 8 << 30
    for m in small["models"]:
        m["fits"] = False
    notes = [p for p in doctor.find_problems(small) if "does not fit" in p.problem]
    assert len(notes) == 2 and all("kvfold plan --config" in p.fix and "--tp N" in p.fix for p in notes)
    assert doctor.exit_status(notes) == 0


def test_the_extras_listed_are_pyprojects():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, packages in doctor.EXTRAS.items():
        names = {req.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
                 for req in extras[extra]}
        assert names == set(packages), extra
    assert set(doctor.EXTRAS) == set(extras) - {"dev"}


def test_the_shipped_configs_are_the_test_data():
    """kvfold/assets/configs ships what tests/data holds (test_plan checks plan against those)."""
    for shipped, data in (("deepseek_v4_flash.json", "deepseek_v4_flash_config.json"),
                          ("glm5_3_flash.json", "glm5_3_flash_config.json")):
        assert json.loads((doctor.SHIPPED_CONFIGS / shipped).read_text()) == \
            json.loads((ROOT / "tests" / "data" / data).read_text())


def test_a_missing_compiler_for_real_exits_1(tmp_path):
    """CC pointing nowhere and an empty cache (the library is built per cache, and cached per
    process: hence a fresh process)."""
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), KVFOLD_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-m", "kvfold", "doctor"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"CC={tmp_path / 'no-such-cc'} is not an executable" in run.stdout
    assert "apt-get install gcc" in run.stdout and "tiny:    loads and runs" in run.stdout
