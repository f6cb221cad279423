"""The command lines (serving.server, serving.demo, profiles.bench_serving) refuse a bad argument at parse time, in
one line on stderr with exit status 2, before any model (or device, or tokenizer) is touched; --help documents
every flag with its default."""
import pytest
import torch

from model.load import check_model_spec
from profiles import bench_serving
from serving import demo, server


def no_loading(monkeypatch):
    """Fail the test if a command gets as far as picking a device or loading a model or the tokenizer."""
    def fail(*args, **kwargs):
        raise AssertionError("the command went on past argument parsing")
    for module in (server, demo, bench_serving):
        monkeypatch.setattr(module, "pick_device", fail)
    monkeypatch.setattr(server, "load_model", fail)
    monkeypatch.setattr(server, "tokenizer_for_model", fail)
    monkeypatch.setattr(demo.load, "load_model", fail)
    monkeypatch.setattr(bench_serving, "load_model", fail)


def refused(capsys, main, argv, *expected) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


MAINS = {"server": server.main, "demo": demo.main, "bench": bench_serving.main}


@pytest.mark.parametrize("name", list(MAINS))
def test_a_model_that_is_neither_a_preset_nor_a_checkpoint_is_refused(name, capsys, monkeypatch, tmp_path):
    no_loading(monkeypatch)
    err = refused(capsys, MAINS[name], ["--model", "nosuch"], "argument --model", "'nosuch'", "not a preset name")
    assert "tiny" in err  # the presets are listed
    refused(capsys, MAINS[name], ["--model", str(tmp_path)], "argument --model", "config.json", "safetensors")
    (tmp_path / "config.json").write_text("{}")
    refused(capsys, MAINS[name], ["--model", str(tmp_path)], "argument --model", "safetensors")


def test_check_model_spec():
    check_model_spec("tiny")
    check_model_spec("Qwen3.5-2B")  # presets match case-insensitively, as get_preset does
    with pytest.raises(ValueError, match="not a preset name"):
        check_model_spec("nosuch")
    with pytest.raises(ValueError, match="a file, not a folder"):
        check_model_spec(__file__)


def test_a_checkpoint_folder_passes_the_check(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_model_spec(str(tmp_path))  # what is in the files is load_checkpoint's to check


@pytest.mark.parametrize("argv, flag", [
    (["--port", "99999"], "--port"), (["--port", "0"], "--port"), (["--port", "-1"], "--port"),
    (["--max-queued", "0"], "--max-queued"), (["--max-queued", "-5"], "--max-queued"),
    (["--max-body-bytes", "0"], "--max-body-bytes"), (["--tp", "0"], "--tp"), (["--kv-tokens", "0"], "--kv-tokens"),
    (["--max-num-seqs", "0"], "--max-num-seqs"), (["--max-model-len", "0"], "--max-model-len"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
    (["--port", "http"], "--port"), (["--speculative-tokens", "5"], "--speculative-tokens"),
    (["--speculative-tokens", "-1"], "--speculative-tokens"),
    (["--speculative-draft-vocab", "-1"], "--speculative-draft-vocab"),
    (["--speculative-draft-vocab", "4096"], "--speculative-draft-vocab"),  # without --speculative-tokens
])
def test_server_refuses_nonsensical_numbers_before_loading_anything(argv, flag, capsys, monkeypatch):
    no_loading(monkeypatch)
    refused(capsys, server.main, argv, f"argument {flag}", "python -m serving.server: error:")


@pytest.mark.parametrize("argv, flag", [(["--max-new-tokens", "0"], "--max-new-tokens"),
                                        (["--max-context", "-1"], "--max-context"),
                                        (["--speculative-tokens", "9"], "--speculative-tokens"),
                                        (["--speculative-draft-vocab", "64"], "--speculative-draft-vocab")])
def test_demo_refuses_nonsensical_numbers(argv, flag, capsys, monkeypatch):
    no_loading(monkeypatch)
    refused(capsys, demo.main, argv, f"argument {flag}", "python -m serving.demo: error:")


@pytest.mark.parametrize("argv, flag", [
    (["--concurrency", "0"], "--concurrency"), (["--turns", "0"], "--turns"), (["--max-new", "0"], "--max-new"),
    (["--scale", "0"], "--scale"), (["--scale", "inf"], "--scale"), (["--page-size", "0"], "--page-size"),
    (["--chunk", "-1"], "--chunk"), (["--interleave", "-1"], "--interleave"),
    (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization"),
    (["--speculative-tokens", "5"], "--speculative-tokens"),
    (["--speculative-tokens", "2", "--speculative-draft-vocab", "x"], "--speculative-draft-vocab")])
def test_bench_refuses_nonsensical_numbers(argv, flag, capsys, monkeypatch):
    no_loading(monkeypatch)
    refused(capsys, bench_serving.main, argv, f"argument {flag}", "python -m profiles.bench_serving: error:")


def test_server_args_parse_and_the_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("FA4_API_KEY", "sekret")
    args = server.parse_args(["--port", "65535", "--max-queued", "1", "--model", "tiny"])
    assert (args.port, args.max_queued, args.model, args.api_key) == (65535, 1, "tiny", "sekret")
    assert server.parse_args(["--api-key", "k"]).api_key == "k"
    assert server.parse_args(["--speculative-tokens", "3"]).speculative_tokens == 3
    assert server.engine_config(server.parse_args(["--speculative-tokens", "2"]), torch.device("cpu"),
                                ()).speculative_tokens == 2
    spec = server.parse_args(["--speculative-tokens", "2", "--speculative-draft-vocab", "32768"])
    assert server.engine_config(spec, torch.device("cpu"), ()).draft_vocab_size == 32768


def help_text(main, capsys, monkeypatch) -> str:
    """--help's text, one line an option (a wide terminal), exit status 0."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def undocumented(text: str, flags: list[str]) -> list[str]:
    """The flags without help text in --help: on the flag's line after the flag and its metavar or choices, or (a
    long flag) on the next line, indented."""
    lines = text.splitlines()
    starts = {line.split()[0].rstrip(","): i for i, line in enumerate(lines) if line.startswith("  -")}
    missing = []
    for flag in flags:
        i = starts[flag]
        inline = len(lines[i].strip().split("  ", 1)) == 2
        below = i + 1 < len(lines) and lines[i + 1].startswith(" " * 8) and lines[i + 1].strip()
        if not (inline or below):
            missing.append(flag)
    return missing


SERVER_FLAGS = ["--model", "--host", "--port", "--device", "--max-model-len", "--kv-tokens", "--gpu-memory-utilization",
                "--eager", "--max-num-seqs", "--api-key", "--max-body-bytes", "--max-queued", "--served-model-name",
                "--tp", "--state-cache-fraction", "--state-cache-gb"]


def test_server_help_documents_every_flag_its_default_and_the_endpoints(capsys, monkeypatch):
    monkeypatch.setenv("FA4_API_KEY", "sekret")
    text = help_text(server.main, capsys, monkeypatch)
    assert text.startswith("usage: python -m serving.server")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"):
        assert path in text
    assert "sekret" not in text  # the key is read after parsing, never printed as a default
    assert undocumented(text, SERVER_FLAGS) == []
    assert "--port PORT" in text and "(default: 8000)" in text and "(default: 256)" in text
    assert "(default: tiny)" in text


def test_demo_and_bench_help_name_the_module_and_document_every_flag(capsys, monkeypatch):
    text = help_text(demo.main, capsys, monkeypatch)
    assert text.startswith("usage: python -m serving.demo") and "demo.py" not in text
    assert undocumented(text, ["--model", "--device", "--max-new-tokens", "--max-context", "--ops", "--eager",
                               "--state-cache-fraction", "--state-cache-gb"]) == []
    assert "(default: 32)" in text and "(default: 8192)" in text
    text = help_text(bench_serving.main, capsys, monkeypatch)
    assert text.startswith("usage: python -m profiles.bench_serving")
    flags = [line.split()[0].rstrip(",") for line in text.splitlines() if line.startswith("  --")]
    assert "--no-progress" in flags and "--seed" in flags and len(flags) > 25
    assert undocumented(text, flags) == []
    assert "(default: 0.85)" in text and "(default: 0)" in text  # a default of 0 shows too
