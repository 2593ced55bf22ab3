"""The tier rule (support/tiers.py) reads what a test and its fixtures name, through helpers defined under tests/:
these planted functions are never run, only classified. The tests reach them through PLANTED, a dict the rule does
not follow, so this file stays in the quick tier."""

from __future__ import annotations

from types import SimpleNamespace

from support.lazy_import import LazyModule
from support.tiers import Classifier

from kvforge.builder.build import build_engine

torch_later = LazyModule("torch")


def _pure() -> int:
    return sum(range(3))


def _builds(tmp_path) -> None:
    build_engine(tmp_path / "onnx", tmp_path / "engine", None)


def _calls_a_builder(tmp_path) -> None:
    _builds(tmp_path)  # two hops: the rule follows helpers defined under tests/


def _imports_torch_inside() -> None:
    import torch  # noqa: F401


def _reads_a_lazy_module() -> object:
    return torch_later.zeros


def _asks_by_name(request) -> None:
    request.getfixturevalue("planted_engine_fixture")


def _runs_a_script(run_cli) -> None:
    run_cli(["llm_build", "--help"])


PLANTED = {f.__name__: f for f in (_pure, _builds, _calls_a_builder, _imports_torch_inside, _reads_a_lazy_module,
                                   _asks_by_name, _runs_a_script)}


def _item(function: str, fixtures: dict[str, str] | None = None, marker: str | None = None) -> SimpleNamespace:
    fixtures = fixtures or {}
    return SimpleNamespace(
        obj=PLANTED[function], fixturenames=list(fixtures), _fixtureinfo=SimpleNamespace(
            name2fixturedefs={name: [SimpleNamespace(func=PLANTED[f])] for name, f in fixtures.items()}),
        get_closest_marker=lambda name: object() if name == marker else None)


def _tiers(item: SimpleNamespace, *others: SimpleNamespace) -> set[str]:
    return Classifier([item, *others]).tiers(item)


def test_a_pure_test_is_in_the_quick_tier() -> None:
    assert _tiers(_item("_pure", {"tmp_path": "_pure"})) == set()


def test_building_is_engine_directly_through_helpers_and_through_fixtures() -> None:
    assert _tiers(_item("_builds")) == {"engine"}
    assert _tiers(_item("_calls_a_builder")) == {"engine"}
    assert _tiers(_item("_pure", {"engine_dir": "_calls_a_builder"})) == {"engine"}
    assert _tiers(_item("_pure", marker="model")) == {"engine"}  # the real SmolLM2


def test_a_fixture_asked_for_by_name_counts() -> None:
    other = _item("_pure", {"planted_engine_fixture": "_builds"})  # another test makes the fixture known
    assert _tiers(_item("_asks_by_name"), other) == {"engine"}


def test_torch_is_seen_imported_inside_or_lazily() -> None:
    assert _tiers(_item("_imports_torch_inside")) == {"torch"}
    assert _tiers(_item("_reads_a_lazy_module")) == {"torch"}


def test_a_console_script_is_cli() -> None:
    assert _tiers(_item("_runs_a_script", {"run_cli": "_pure"})) == {"cli"}
    assert _tiers(_item("_pure", {"run_cli_inprocess": "_pure"})) == {"cli"}


def test_collection_leaves_a_lazy_module_unimported() -> None:
    """What collection probes (pytestmark, dunders) must not import it: the quick tier stays torch-free."""
    lazy = LazyModule("a_module_that_is_not_installed")
    for probe in ("pytestmark", "__test__", "_pytestfixturefunction"):
        assert getattr(lazy, probe, None) is None


def test_a_serial_test_in_a_file_that_never_says_so_is_named(tmp_path) -> None:
    """make test's serial passes collect only the files a grep finds saying `serial`: conftest refuses a run in
    which a serial test sits in another file (there it would run in no pass)."""
    from conftest import serial_tests_in_unsaid_files

    said, unsaid = tmp_path / "test_said.py", tmp_path / "test_unsaid.py"
    said.write_text("@pytest.mark.serial\ndef test_a(): ...\n")
    unsaid.write_text("@SLOW_ALONE  # a marker made elsewhere; 'serialized' is no mention\ndef test_b(): ...\n")

    def item(path, serial: bool) -> SimpleNamespace:
        return SimpleNamespace(path=path, get_closest_marker=lambda name: object() if serial else None)

    items = [item(said, True), item(unsaid, True), item(unsaid, True), item(tmp_path / "test_other.py", False)]
    assert serial_tests_in_unsaid_files(items) == [str(unsaid)]
    assert serial_tests_in_unsaid_files(items[:1]) == []
