"""Run in a fresh interpreter whose sys.path holds a plugin distribution: compare with it by name.

argv: store, expected run, actual run, baseline run. Prints the comparison id and the names of
the registered comparators as JSON."""
import json
import sys


def main():
    from capturestore import Store
    from capturestore.analysis import compare_runs
    from capturestore.comparators import comparator_names

    store, exp, act, base = sys.argv[1:5]
    res = compare_runs(Store.open(store), expected_run=exp, actual_run=act, baseline_run=base, comparators=["plug"])
    print(json.dumps({"comparison_id": res.comparison_id, "names": comparator_names(), "passed": res.passed,
                      "localisation": res.localisation}))


if __name__ == "__main__":
    main()
