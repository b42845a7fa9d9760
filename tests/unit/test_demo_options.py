"""The demo refuses options under which its table would mislabel its rows."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.tools.demo import DemoOptions, check_options


@pytest.mark.parametrize("kw,key", [
    ({"docs": 0}, "--docs"),
    ({"docs": 40}, "--docs"),  # more than the library's 30 reference pages: refused before any model is built
    ({"docs": 2}, "--docs"),  # 2 x 48 blocks fit 110: the repeats would be device hits, not kvtier's
    ({"doc_tokens": 8000}, "--doc-tokens"),  # longer than the device cache
])
def test_options_the_table_could_not_honour_are_refused(kw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_options(DemoOptions(**kw))
    assert info.value.key == key


def test_the_defaults_and_the_e2e_tests_options_pass() -> None:
    check_options(DemoOptions())
    check_options(DemoOptions(geometry="tiny", docs=3, doc_tokens=800, device_blocks=30))
