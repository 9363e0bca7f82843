"""Print the skipped tests of a pytest JUnit report, one ``test: reason`` a line.

The GPU suite (docker/gpu_suite.sh) fails when a GPU or TensorRT test was skipped inside the
image, where all of them must run. Expected failures (``xfail``), which JUnit also files as
skipped, are not counted.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def skipped_tests(junit_xml: str | Path) -> list[str]:
    found = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None and skipped.get("type") != "pytest.xfail":
            found.append(f"{case.get('classname')}::{case.get('name')}: {skipped.get('message', '')}")
    return found


if __name__ == "__main__":
    for line in skipped_tests(sys.argv[1]):
        print(line)
