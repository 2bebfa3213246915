"""A plan-protocol proxy that holds every line to the JSON Schemas in src/running/external/schema/.

Usage: python3 tests/planners/schema_proxy.py PLANNER-COMMAND...
Forwards kvrelay's lines to the planner (e.g. `kvrelay planner`) and its answers back, after checking each line
against the required keys, constants and $defs of its schema branch (a dependency-free subset of JSON Schema:
`required`, `const`, `$ref`, `properties`, `items`, `oneOf` by `type`). On the first violation it prints the line
and the missing key on stderr and exits 1, so `kvrelay check --planner` fails the case with a protocol error.
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = os.path.join(HERE, "..", "..", "src", "running", "external", "schema")


def load(name):
    with open(os.path.join(SCHEMA, name)) as handle:
        return json.load(handle)


def check(value, schema, root, path):
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].split("/")[-1]]
    if "const" in schema and value != schema["const"]:
        raise ValueError(f"{path}: {value!r} is not {schema['const']!r}")
    if "oneOf" in schema and isinstance(value, dict) and "type" in value:
        branches = [b for b in schema["oneOf"] if b.get("properties", {}).get("type", {}).get("const") == value["type"]]
        if not branches:
            raise ValueError(f"{path}: no schema branch for type {value['type']!r}")
        schema = branches[0]
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise ValueError(f"{path}: missing `{key}`")
        for key, sub in schema.get("properties", {}).items():
            if key in value and value[key] is not None:
                check(value[key], sub, root, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            check(item, schema["items"], root, f"{path}[{index}]")


def main():
    query_schema, answer_schema = load("query.schema.json"), load("answer.schema.json")
    planner = subprocess.Popen(sys.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in sys.stdin:
        try:
            check(json.loads(line), query_schema, query_schema, "query")
            planner.stdin.write(line)
            planner.stdin.flush()
            answer = planner.stdout.readline()
            check(json.loads(answer), answer_schema, answer_schema, "answer")
        except ValueError as error:
            print(f"schema violation: {error}", file=sys.stderr)
            sys.exit(1)
        sys.stdout.write(answer)
        sys.stdout.flush()


main()
