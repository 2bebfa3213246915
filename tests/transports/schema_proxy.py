"""A kvrelay-transport-1 proxy that holds every line to the JSON Schemas in src/fabric/child/schema/.

Usage: python3 tests/transports/schema_proxy.py CHILD-COMMAND...
Forwards kvrelay's requests to the child (e.g. `python3 tests/transports/memcpy_engine.py`) and its responses back,
checking each line against its schema with a dependency-free subset of JSON Schema (`$ref`, `type`, `const`,
`enum`, `required`, `properties`, `additionalProperties`, `items`, `minItems`, `maxItems`, `minimum`, `maximum`,
`pattern`, `oneOf`) and that a response answers its request's `op` and `seq`. On the first violation it prints the
line and the reason on stderr and exits 1, so kvrelay reports the child broken.
"""

import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = os.path.join(HERE, "..", "..", "src", "fabric", "child", "schema")
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def load(name):
    with open(os.path.join(SCHEMA, name)) as handle:
        return json.load(handle)


def is_type(value, name):
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, TYPES[name])


def check(value, schema, root, path):
    """Raises ValueError naming the path of the first violation."""
    if "$ref" in schema:
        return check(value, root["$defs"][schema["$ref"].split("/")[-1]], root, path)
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(is_type(value, name) for name in names):
            raise ValueError(f"{path}: {value!r} is not of type {schema['type']}")
    if "const" in schema and (value != schema["const"] or type(value) is not type(schema["const"])):
        raise ValueError(f"{path}: {value!r} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"{path}: {value!r} is not one of {schema['enum']}")
    if is_type(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            raise ValueError(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            raise ValueError(f"{path}: {value} > {schema['maximum']}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        raise ValueError(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise ValueError(f"{path}: missing `{key}`")
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                check(item, properties[key], root, f"{path}.{key}")
            elif extra is False:
                raise ValueError(f"{path}: unexpected field `{key}`")
            elif isinstance(extra, dict):
                check(item, extra, root, f"{path}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            raise ValueError(f"{path}: {len(value)} items")
        if "items" in schema:
            for index, item in enumerate(value):
                check(item, schema["items"], root, f"{path}[{index}]")
    if "oneOf" in schema:
        errors, matched = [], 0
        for branch in schema["oneOf"]:
            try:
                check(value, branch, root, path)
                matched += 1
            except ValueError as error:
                errors.append(str(error))
        if matched != 1:
            # The branch of the same `op` (or `event`, or `ok`) says most.
            def same(branch):
                properties = branch.get("properties", {})
                keys = [key for key in ("op", "event", "ok") if "const" in properties.get(key, {})]
                return bool(keys) and all(isinstance(value, dict) and value.get(key) == properties[key]["const"] for key in keys)
            hint = [error for branch, error in zip(schema["oneOf"], errors) if same(branch)] or errors
            raise ValueError(f"{path}: matches {matched} of the branches; {hint[0] if hint else ''}")


def main():
    requests, responses = load("request.schema.json"), load("response.schema.json")
    child = subprocess.Popen(sys.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            check(request, requests, requests, "request")
            child.stdin.write(line)
            child.stdin.flush()
            answer = child.stdout.readline()
            if not answer:
                sys.exit(child.wait() or 1)
            response = json.loads(answer)
            check(response, responses, responses, "response")
            if (response["op"], response["seq"]) != (request["op"], request["seq"]):
                raise ValueError(f"response to {request['op']} {request['seq']} answers {response['op']} {response['seq']}")
        except ValueError as error:
            print(f"schema violation: {error}\n  line: {line.strip()[:300]}", file=sys.stderr)
            sys.exit(1)
        sys.stdout.write(answer)
        sys.stdout.flush()
        if request["op"] == "bye":
            break
    child.wait()


main()
