"""Every parser, fed random and malformed input, fails only with a PartitaError.

A user's file or flag must never produce a traceback: the CLI catches PartitaError and
prints its one line, and nothing else. Each test throws three kinds of input at one parser:
random JSON-like data, valid specs with a few mutations (a key dropped, a value swapped for
a wrong type, a negative, huge or non-finite number, a bool where an int goes, None), and
for the text parsers random text and bytes. Whatever a parser accepts must also write back
out (``to_dict``), so garbage that is accepted is caught too.
"""

import copy
import json
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from partita import specio
from partita.cluster import ClusterSpec, load_cluster, parse_short
from partita.devices import ALIASES, CATALOG
from partita.errors import PartitaError
from partita.hf import load_hf_config, spec_from_hf
from partita.model import BUILTIN, ModelSpec
from partita.model_io import load_model
from partita.plan import Plan
from partita.profile import Profile
from spec_helpers import hand_plan, hand_profile  # hand-built valid plan and profile

# 200 examples a parser keeps the file under 30 s; PARTITA_FUZZ_EXAMPLES=5000 for a deeper run.
FUZZ = settings(max_examples=int(os.environ.get("PARTITA_FUZZ_EXAMPLES", 200)), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
HF_DATA = Path(__file__).parent / "data" / "hf"
CONFIGS = Path(__file__).parent.parent / "configs"

# ---- strategies ---------------------------------------------------------------------------

# Values that break careless parsers: wrong types, zero, negatives, bools (ints in Python),
# integers too large for a float, non-finite floats, empty containers.
NASTY = st.sampled_from([None, True, False, 0, -1, 1, 3, 2**63, 10**400, -(10**30), 0.5, -0.0, 1e308,
                         float("inf"), float("-inf"), float("nan"), "", "x", "8", "H100", [], [1], [None],
                         {}, {"a": 1}, {"name": "x"}])

SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | NASTY)


def json_like(keys: st.SearchStrategy = st.text(max_size=10)) -> st.SearchStrategy:
    return st.recursive(SCALARS, lambda children: st.lists(children, max_size=4)
                        | st.dictionaries(keys, children, max_size=6), max_leaves=15)


def locations(data):
    """Every (container, key-or-index) in a nested dict/list."""
    out = []
    stack = [data]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            out.append((node, k))
            stack.append(v)
    return out


def fresh(value):
    """A copy: sampled constants like [] are shared between examples, and mutations edit in place."""
    return copy.deepcopy(value)


@st.composite
def mutated(draw, bases: list, extra_keys: list[str] = ()):
    """A valid dict with 1-3 mutations somewhere in its tree."""
    data = copy.deepcopy(draw(st.sampled_from(bases)))
    for _ in range(draw(st.integers(1, 3))):
        spots = locations(data)
        if not spots:
            break
        node, key = spots[draw(st.integers(0, len(spots) - 1))]
        op = draw(st.sampled_from(["drop", "nasty", "random", "add", "negate"]))
        if op == "drop":
            del node[key]
        elif op == "nasty":
            node[key] = fresh(draw(NASTY))
        elif op == "random":
            node[key] = fresh(draw(json_like()))
        elif op == "negate" and isinstance(node[key], (int, float)) and not isinstance(node[key], bool):
            node[key] = -node[key] * draw(st.sampled_from([1, 10**12]))
        elif op == "add" and isinstance(node, dict):
            node[draw(st.sampled_from(list(extra_keys) + ["colour"]) | st.text(max_size=8))] = fresh(draw(SCALARS))
        elif isinstance(node, list):
            node.append(fresh(draw(SCALARS | json_like())))
    return data


def only_partita_error(parse, arg):
    """Parse; a PartitaError is a fine answer, any other exception fails the test (by escaping).
    What parses must write back out."""
    try:
        result = parse(arg)
    except PartitaError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        return None
    if hasattr(result, "to_dict"):
        specio.dump_yaml(result.to_dict())
    return result


MODEL_BASES = [m.to_dict() for m in BUILTIN.values()]
CLUSTER_BASES = [parse_short(s).to_dict() for s in ("8xH100", "4x8xA100-80GB+2x8xH100", "4xcpu")] + [
    specio.load_yaml(p) for p in sorted((CONFIGS / "clusters").glob("*.yaml"))]
PLAN_BASES = [hand_plan(True).to_dict(), hand_plan(False).to_dict()]
PROFILE_BASES = [hand_profile().to_dict()]
HF_BASES = [json.loads(p.read_text()) for p in sorted(HF_DATA.glob("*.json"))]
HF_KEYS = sorted({k for c in HF_BASES for k in c} | {"head_dim", "num_experts", "moe_num_experts", "n_routed_experts"})
DEVICE_NAMES = list(CATALOG) + list(ALIASES)


def field_keys(bases) -> list[str]:
    return sorted({k for b in bases for k in b})


# ---- the parsers ------------------------------------------------------------------------

SHORT_TEXT = st.lists(st.sampled_from(["8", "4", "0", "x", "X", "+", " ", "-", "H100", "cpu", "a100", "99999"]
                                      + DEVICE_NAMES) | st.text(max_size=6), max_size=8).map("".join)


@FUZZ
@given(st.text(max_size=40) | SHORT_TEXT | st.from_regex(r"\A(\d{1,5}x){0,3}[A-Za-z][\w.-]{0,8}(\+\d{0,5}x?\w{0,6}){0,2}\Z"))
def test_parse_short(text):
    only_partita_error(parse_short, text)


# A --model or --cluster argument: a name, a short form or a path. No "/" in random text, so
# no example can wander into /dev; the explicit examples are names no file can have.
REFS = st.text(st.characters(blacklist_characters="/"), max_size=30) | SHORT_TEXT | st.sampled_from(
    ["", ".", "..", "x.yaml", "x.json", "gpt2", "8xH100"])


@FUZZ
@given(REFS)
@example("a" * 5000)  # OSError: file name too long
@example("a" * 300 + ".yaml")
@example("x\x00y.json")  # ValueError: embedded null byte
@example("pyproject.toml/x.yaml")  # NotADirectoryError
@example("9" * 5000 + "xH100")  # int() refuses more than 4300 digits
def test_model_and_cluster_references(ref):
    only_partita_error(load_model, ref)
    only_partita_error(load_cluster, ref)
    if ref.endswith(".json"):
        only_partita_error(load_hf_config, ref)


@FUZZ
@given(json_like(st.sampled_from(field_keys(MODEL_BASES)) | st.text(max_size=6)) | mutated(MODEL_BASES))
@example(BUILTIN["gpt2"].to_dict() | {"rope_theta": 10**400})  # float() overflowed
def test_model_from_dict(data):
    only_partita_error(ModelSpec.from_dict, data)


@FUZZ
@given(json_like(st.sampled_from(field_keys(CLUSTER_BASES) + ["device", "nodes", "memory_gib"]))
       | mutated(CLUSTER_BASES, ["memory_gib", "inter_group_gbps", "gpus_per_node"]))
@example({"groups": [{"device": "H100", "memory_gib": float("inf")}]})  # int(inf) overflowed
@example({"groups": [{"device": "H100", "memory_gib": 10**400}]})
@example({"groups": [{"device": "H100", "memory_gib": 1e308}]})  # finite, but not in bytes
def test_cluster_from_dict(data):
    only_partita_error(ClusterSpec.from_dict, data)


@FUZZ
@given(json_like(st.sampled_from(field_keys(PLAN_BASES))) | mutated(PLAN_BASES, ["prediction", "solver", "zero"]))
@example(PLAN_BASES[0] | {"prediction": PLAN_BASES[0]["prediction"] | {"mfu": None}})  # float(None)
@example(PLAN_BASES[0] | {"prediction": PLAN_BASES[0]["prediction"] | {"stage_time_s": 3}})
@example(PLAN_BASES[0] | {"prediction": PLAN_BASES[0]["prediction"] | {"breakdown": [1]}})
@example(PLAN_BASES[0] | {"prediction": PLAN_BASES[0]["prediction"]  # accepted, then to_dict failed
                          | {"memory": [PLAN_BASES[0]["prediction"]["memory"][0] | {"weights_bytes": None}]}})
def test_plan_from_dict(data):
    only_partita_error(Plan.from_dict, data)


@FUZZ
@given(json_like(st.sampled_from(field_keys(PROFILE_BASES))) | mutated(PROFILE_BASES, ["kind", "layers", "comm"]))
def test_profile_from_dict(data):
    only_partita_error(Profile.from_dict, data)


@FUZZ
@given(json_like(st.sampled_from(HF_KEYS) | st.text(max_size=6)) | mutated(HF_BASES, HF_KEYS))
def test_spec_from_hf(config):
    only_partita_error(lambda c: spec_from_hf(c, "fuzz"), config)


@FUZZ
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode)
       | st.sampled_from(HF_BASES).map(lambda c: json.dumps(c).encode()).flatmap(
           lambda b: st.integers(0, len(b)).map(lambda i: b[:i])))
def test_load_hf_config_file(content):
    fd, path = tempfile.mkstemp(suffix=".json")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        only_partita_error(load_hf_config, path)
    finally:
        os.unlink(path)


YAML_PIECES = st.sampled_from(["a: 1\n", "- x\n", "  ", ": ", "!!int ", "!!float ", "!!timestamp ", "!!binary ",
                               "!!python/object ", "2001-13-45", "&a ", "*a", "<<: ", "{", "}", "[", "]", "? ",
                               "'", '"', "\t", "\x00", "\ufeff", "%YAML 1.1\n", "---\n", "...\n", "|\n", ".inf",
                               "0x1F", "1e400", "~"])


@FUZZ
@given(st.text(max_size=80) | st.lists(YAML_PIECES | st.text(max_size=4), max_size=12).map("".join))
@example("2001-13-45")  # PyYAML: ValueError from datetime
@example("!!int abc")
@example("!!int")  # IndexError
@example("!!timestamp x")  # AttributeError
@example("\x1f")  # a ReaderError, whose text spans two lines
def test_parse_yaml_text(text):
    only_partita_error(specio.parse_yaml, text)


@FUZZ
@given(st.binary(max_size=120))
def test_parse_yaml_bytes(data):
    only_partita_error(specio.parse_yaml, data)


def test_parse_yaml_deep_nesting():
    only_partita_error(specio.parse_yaml, "[" * 1500)
