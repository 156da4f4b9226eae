"""The end of .ci/run: each lane's time and exit code, and the slowest tests of all lanes (from their JUnit XML), so
that the next regression in CI time shows itself. Usage: report.py N LANE=SECONDS:RC:XML ... (stdlib only)."""
import sys
import xml.etree.ElementTree as ET


def cases(xml: str):
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for tc in root.iter("testcase"):
        out.append((float(tc.get("time") or 0.0), f"{tc.get('classname', '')}::{tc.get('name', '')}"))
    return out


def main(argv):
    n = int(argv[0])
    rows, slow = [], []
    for arg in argv[1:]:
        name, rest = arg.split("=", 1)
        secs, rc, xml = rest.split(":", 2)
        cs = cases(xml)
        rows.append((name, int(secs), int(rc), len(cs), sum(t for t, _ in cs)))
        slow += [(t, name, c) for t, c in cs]
    print("=== CI summary: lanes (wall seconds, including each lane's own set-up)")
    for name, secs, rc, count, tsum in rows:
        print(f"lane {name}: exit {rc}, {secs} s wall, {count} tests, {tsum:.0f} s in test bodies")
    print(f"=== the {n} slowest tests (seconds, lane, test; fixture set-up counts toward the first test using it)")
    for t, name, c in sorted(slow, reverse=True)[:n]:
        print(f"{t:8.1f}  {name:12s} {c}")


if __name__ == "__main__":
    main(sys.argv[1:])
