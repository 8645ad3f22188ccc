#!/usr/bin/env python3
"""Evaluate the ValidatingAdmissionPolicy in a manifest against admission requests, offline.

    vap_simulate.py MANIFEST POLICY_NAME < cases.json > decisions.json

cases.json is a list of {"operation", "resource", "subresource", "name", "userInfo",
"object", "oldObject"}; the answer is one {"matched", "allowed", "denied_by"} per case.

It mirrors what the API server does with a policy (Kubernetes 1.30+): matchConstraints on
resource and operation, then matchConditions, then the variables and validations, with
`object`/`oldObject` as plain maps (the API server declares them `dyn` and hands CEL the
unstructured object) and CEL optionals enabled. failurePolicy Fail: an expression that errors
denies. The CEL engine is Google's cel-cpp (PyPI cel-expr-python), not the API server's cel-go,
so this checks the policy's logic and syntax, not the API server's cost limits.
"""

import json
import sys

import yaml
from cel_expr_python import cel
from cel_expr_python.ext import ext_optional


def load_policy(path, name):
    with open(path, encoding="utf-8") as f:
        for doc in yaml.safe_load_all(f):
            if (
                doc
                and doc.get("kind") == "ValidatingAdmissionPolicy"
                and doc["metadata"]["name"] == name
            ):
                return doc["spec"]
    sys.exit(f"{path}: no ValidatingAdmissionPolicy named {name!r}")


ENV = cel.NewEnv(
    variables={
        name: cel.Type.DYN for name in ("object", "oldObject", "request", "variables")
    },
    extensions=[ext_optional.ExtOptional()],
)


def compile_all(spec):
    """Compile every expression up front, so a syntax error fails loudly, not as a deny."""
    out = {"match": [], "vars": [], "validations": []}
    for mc in spec.get("matchConditions", []):
        out["match"].append((mc["name"], ENV.compile(mc["expression"])))
    for v in spec.get("variables", []):
        out["vars"].append((v["name"], ENV.compile(v["expression"])))
    for v in spec.get("validations", []):
        msg = v.get("message")
        msg_expr = ENV.compile(v["messageExpression"]) if "messageExpression" in v else None
        out["validations"].append((ENV.compile(v["expression"]), msg, msg_expr))
    return out


def evaluate(expr, data):
    """(value, None) or (None, error text)."""
    try:
        return expr.eval(data=data).plain_value(), None
    except Exception as e:  # cel-cpp raises on evaluation errors
        return None, str(e)


def matches_constraints(spec, case):
    resource = case["resource"] + ("/" + case["subresource"] if case.get("subresource") else "")
    for rule in spec["matchConstraints"]["resourceRules"]:
        if (
            "" in rule["apiGroups"]
            and case["operation"] in rule["operations"]
            and resource in rule["resources"]
        ):
            return True
    return False


def decide(spec, compiled, case):
    if not matches_constraints(spec, case):
        return {"matched": False, "allowed": True, "denied_by": None}
    request = {
        "operation": case["operation"],
        "name": case.get("name", ""),
        "resource": {"group": "", "version": "v1", "resource": case["resource"]},
        "subResource": case.get("subresource", ""),
        "userInfo": case["userInfo"],
    }
    data = {
        "object": case.get("object"),
        "oldObject": case.get("oldObject"),
        "request": request,
        "variables": {},
    }
    for name, expr in compiled["match"]:
        value, err = evaluate(expr, data)
        if err is not None:
            return {"matched": True, "allowed": False, "denied_by": f"matchCondition {name}: {err}"}
        if value is not True:
            return {"matched": False, "allowed": True, "denied_by": None}
    # The API server evaluates variables lazily; evaluating them in order and leaving out the
    # ones that fail gives the same answers, because a validation that reads a failed variable
    # then fails too (unless a short-circuit skips it, as it would there).
    variables = {}
    for name, expr in compiled["vars"]:
        value, err = evaluate(expr, {**data, "variables": variables})
        if err is None:
            variables[name] = value
    data["variables"] = variables
    for expr, msg, msg_expr in compiled["validations"]:
        value, err = evaluate(expr, data)
        if err is not None or value is not True:
            text = msg
            if msg_expr is not None:
                rendered, _ = evaluate(msg_expr, data)
                text = rendered if isinstance(rendered, str) else msg
            if err is not None:
                text = f"{text} (evaluation error: {err})"
            return {"matched": True, "allowed": False, "denied_by": text}
    return {"matched": True, "allowed": True, "denied_by": None}


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    spec = load_policy(sys.argv[1], sys.argv[2])
    compiled = compile_all(spec)
    cases = json.load(sys.stdin)
    json.dump([decide(spec, compiled, c) for c in cases], sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
