"""``docs/api.md`` is the full reference, and stays so.

* its index table (section ``## Everything `import torchrefit as tr` offers``) names
  exactly ``torchrefit.__all__``;
* the section of each entry point (``Refitter``, ``connect``, ``swap_model_weights``,
  ``load_weights_sink``, the vLLM backend's init infos) names every argument or field;
* the section of each public class names every public method, property, attribute and
  dataclass field the class defines (``Refitter``'s methods, the reports' fields, ...);
* the README's ``## API`` section links to it and does not repeat it.

A section is a heading naming the object in backticks (``## `Refitter` `` or
``### `StageHandle` ``) and the text up to the next heading of the same or a higher
level; a name counts where a code span in it (not a code block: a signature alone does
not describe) contains the name as a word.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import pytest

import torchrefit as tr

ROOT = pathlib.Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
INDEX = "Everything `import torchrefit as tr` offers"


def sections(text: str) -> list[tuple[int, str, str]]:
    """(level, heading, body) of every markdown heading outside code blocks."""
    out: list[tuple[int, str, list[str]]] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^(#{1,6}) (.*)$", line)
        if m:
            out.append((len(m.group(1)), m.group(2), []))
        elif out:
            out[-1][2].append(line)
    # a section runs on through deeper headings
    full = []
    for i, (level, head, _) in enumerate(out):
        body = []
        for lv, h, lines in out[i:]:
            if lv <= level and h != head:
                break
            body.append(f"{'#' * lv} {h}")
            body.extend(lines)
        full.append((level, head, "\n".join(body)))
    return full


def section_of(name: str, text: str) -> str | None:
    """The section whose heading names ``name`` in backticks (the deepest such one)."""
    found = [(lv, body) for lv, head, body in sections(text) if re.search(rf"`{re.escape(name)}`", head)]
    return max(found, key=lambda f: f[0])[1] if found else None


def mentions(name: str, text: str) -> bool:
    """Whether a code span of ``text`` (code blocks, the signatures, left out) names ``name``."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return any(re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", span)
               for span in re.findall(r"`([^`]+)`", text))


def index_names(text: str) -> set[str]:
    body = dict((head, body) for _, head, body in sections(text))[INDEX]
    names: set[str] = set()
    for row in re.findall(r"^\| ([^|]+) \|", body, re.M):
        names.update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", row))
    return names - {"name"}


def _vllm():
    return pytest.importorskip("torchrefit.engines.vllm", reason="vLLM not installed")


def signature_args(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def own_public(cls) -> list[str]:
    """What ``cls`` itself defines and a user may touch: methods, properties, class
    attributes and dataclass fields not starting with ``_``."""
    names = [k for k in vars(cls) if not k.startswith("_")]
    if dataclasses.is_dataclass(cls):
        names += [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    return sorted(set(names))


def entry_points() -> dict[str, list[str]]:
    """Section name -> the arguments or fields it must name."""
    return {
        "Refitter": signature_args(tr.Refitter.__init__),
        "connect": signature_args(tr.connect),
        "swap_model_weights": signature_args(tr.swap_model_weights),
        "load_weights_sink": signature_args(tr.load_weights_sink),
        "shard_pieces": signature_args(tr.shard_pieces),
        "vllm_tp_layout": signature_args(tr.vllm_tp_layout),
        "weight_version": signature_args(tr.weight_version),
    }


def public_classes() -> list[type]:
    return [obj for name in tr.__all__ if inspect.isclass(obj := getattr(tr, name))
            and not issubclass(obj, BaseException)]


def missing(what: dict[str, list[str]], text: str) -> list[str]:
    problems = []
    for owner, names in what.items():
        body = section_of(owner, text)
        if body is None:
            problems.append(f"no section for `{owner}`: add a heading `## \\`{owner}\\`` (or ###) "
                            f"to docs/api.md naming {', '.join(names)}")
            continue
        lost = [n for n in names if not mentions(n, body)]
        if lost:
            problems.append(f"`{owner}`'s section in docs/api.md does not name "
                            f"{', '.join(f'`{n}`' for n in lost)}: describe each there, in backticks")
    return problems


def test_index_names_exactly_all() -> None:
    documented = index_names(API.read_text())
    assert documented == set(tr.__all__), (
        f"docs/api.md's table under '## {INDEX}' must name exactly torchrefit.__all__: add a row "
        f"for each of {sorted(set(tr.__all__) - documented)}, remove "
        f"{sorted(documented - set(tr.__all__))}")


def test_every_argument_is_documented() -> None:
    problems = missing(entry_points(), API.read_text())
    assert not problems, "\n".join(problems)


def test_every_public_method_and_field_is_documented() -> None:
    problems = missing({cls.__name__: own_public(cls) for cls in public_classes()}, API.read_text())
    assert not problems, "\n".join(problems)


def test_vllm_init_infos_and_sender_are_documented() -> None:
    v = _vllm()
    what = {c.__name__: own_public(c) for c in (v.TorchrefitTrainerInitInfo, v.TorchrefitInitInfo,
                                                v.TorchrefitTrainerWeightTransferEngine)}
    what[v.TorchrefitInitInfo.__name__] += own_public(v.TorchrefitUpdateInfo) + ["TorchrefitUpdateInfo"]
    problems = missing(what, API.read_text())
    assert not problems, "\n".join(problems)


def test_sglang_init_info_sender_and_clients_are_documented() -> None:
    from torchrefit.engines import sglang, sglang_http

    what = {c.__name__: own_public(c) for c in (sglang.SGLangInitInfo, sglang.SGLangSender)}
    what["init_sender"] = signature_args(sglang.init_sender)
    what["HTTPClient"] = own_public(sglang_http.HTTPClient) + signature_args(
        sglang_http.HTTPClient.__init__) + ["EngineClient"] + own_public(sglang.EngineClient)
    problems = missing(what, API.read_text())
    assert not problems, "\n".join(problems)


def test_readme_links_to_the_reference_instead_of_repeating_it() -> None:
    readme = (ROOT / "README.md").read_text()
    api = readme.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    assert "(docs/api.md)" in api
    rows = re.findall(r"^\|", api, re.M)
    assert not rows, "README's ## API section repeats a table: link to docs/api.md instead"


def test_the_checks_see_a_missing_name() -> None:
    text = ("## `Thing`\n\n`Thing(...)`: with `a` only.\n\n### `Part`\n\n`c`\n\n## Other\n\n`d`\n")
    assert missing({"Thing": ["a", "b", "c"]}, text) == [
        "`Thing`'s section in docs/api.md does not name `b`: describe each there, in backticks"]
    assert missing({"Other": ["d"]}, text)[0].startswith("no section for `Other`")
    assert section_of("Part", text).count("`c`") == 1 and "`d`" not in section_of("Thing", text)
