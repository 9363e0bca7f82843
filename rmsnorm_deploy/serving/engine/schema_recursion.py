"""JSON schemas that no finite value satisfies because they require themselves without end: a
required property, an array's first items or an ``allOf`` leading back to the schema it came from
(``{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}``).

llguidance compiles such a schema and lets generation start; the answer can never end, and the
grammar engine gives up somewhere inside it ("Too many items") or the stream runs to
``max_tokens``. Whether a schema can be finished is the productivity of a context-free grammar:
a schema is finishable when each of its needs (its ``$ref``, every ``allOf`` part, one ``anyOf`` /
``oneOf`` branch, one of its types: for an object each required property, for an array its
first ``minItems`` items and ``contains``) is. :func:`endless_requirement` computes it once for
every subschema (linear in the schema: counters over an and/or graph, no recursion, so a deep
schema costs no stack) and names the cycle when the root is not finishable.

Only what the schema certainly requires counts: a ``$ref`` outside the document, ``not``,
``if``/``then``, ``patternProperties`` and the other keywords are taken as finishable, so a
schema is refused here only when no value can match it; contradictions within one schema
(``minimum`` above ``maximum``, an empty ``enum``) are llguidance's to report.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

#: the keywords whose values are subschemas, by shape: one schema, a list, a map of names
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class _Graph:
    """An and/or graph: node ``i`` is productive when all (``and``) or one (``or``) of its children
    is; an ``and`` without children is productive, an ``or`` without children is not."""

    def __init__(self) -> None:
        self.any: list[bool] = []
        self.children: list[list[int]] = []

    def add(self, any_of: bool, children: list[int] | None = None) -> int:
        self.any.append(any_of)
        self.children.append(children if children is not None else [])
        return len(self.any) - 1

    def productive(self) -> list[bool]:
        parents: list[list[int]] = [[] for _ in self.any]
        for node, children in enumerate(self.children):
            for child in children:
                parents[child].append(node)
        waiting = [(1 if self.any[i] else len(c)) for i, c in enumerate(self.children)]
        done = [not self.any[i] and not c for i, c in enumerate(self.children)]
        queue = [i for i, d in enumerate(done) if d]
        while queue:
            node = queue.pop()
            for parent in parents[node]:
                if not done[parent]:
                    waiting[parent] -= 1
                    if waiting[parent] <= 0:
                        done[parent] = True
                        queue.append(parent)
        return done


def _pointer(root: Any, ref: str) -> tuple[str, Any] | None:
    """The subschema a local ``$ref`` (``#`` and a JSON pointer) names, with its canonical key; None
    for anything else (left to llguidance)."""
    if not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node = root
    for raw in ref[2:].split("/") if len(ref) > 1 else []:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return (ref if len(ref) > 1 else "#"), node


class _Schemas:
    """The and/or graph of one schema document, a node per subschema object (a ``$ref`` leads to the
    object it names); each node remembers where it was first found, for the message."""

    def __init__(self, root: Any):
        self.root, self.graph = root, _Graph()
        self.nodes: dict[int, int] = {}  # id(subschema) -> node
        self.found: dict[int, tuple[int | None, str]] = {}  # node -> (the node it was found under, the step)
        self.true = self.graph.add(False)
        self.false = self.graph.add(True)
        self.todo: list[tuple[dict, int]] = []

    def node(self, schema: Any, under: int | None, step: str) -> int:
        if schema is True or schema is None or not isinstance(schema, (dict, bool)):
            return self.true  # (not a schema: llguidance says so)
        if schema is False:
            return self.false
        if id(schema) not in self.nodes:
            node = self.nodes[id(schema)] = self.graph.add(False)
            self.found[node] = (under, step)
            self.todo.append((schema, node))
        return self.nodes[id(schema)]

    def pointer(self, node: int) -> str:
        steps = []
        while node is not None:
            node, step = self.found[node]
            steps.append(step)
        text = "/".join(reversed(steps))
        return text if len(text) <= 120 else text[:50] + "..." + text[-60:]

    def build(self) -> int:
        root = self.node(self.root, None, "#")
        while self.todo:
            schema, node = self.todo.pop()
            self._index(schema, node)
            self.graph.children[node] = self._needs(schema, node)
        return root

    def _index(self, schema: dict, node: int) -> None:
        """Every subschema in the document gets its node (a ``$ref`` may name any of them)."""
        for word in _ONE:
            if isinstance(schema.get(word), (dict, bool)):
                self.node(schema[word], node, word)
        for word in _LIST:
            if isinstance(schema.get(word), list):
                for i, part in enumerate(schema[word]):
                    self.node(part, node, f"{word}/{i}")
        for word in _MAP:
            if isinstance(schema.get(word), dict):
                for name, part in schema[word].items():
                    self.node(part, node, f"{word}/{_escape(name)}")

    def _needs(self, schema: dict, node: int) -> list[int]:
        """What ``schema`` needs, all of it (its node is an ``and``)."""
        graph, needs = self.graph, []
        target = _pointer(self.root, schema.get("$ref"))
        if target is not None:
            needs.append(self.node(target[1], None, target[0]))
        if isinstance(schema.get("allOf"), list):
            needs += [self.node(part, node, f"allOf/{i}") for i, part in enumerate(schema["allOf"])]
        for word in ("anyOf", "oneOf"):
            if isinstance(schema.get(word), list) and schema[word]:
                needs.append(graph.add(True, [self.node(p, node, f"{word}/{i}") for i, p in enumerate(schema[word])]))
        types = schema.get("type", list(_TYPES))
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else list(_TYPES)
        types = [t for t in types if isinstance(t, str)]
        if types and set(types) <= {"object", "array"} and "enum" not in schema and "const" not in schema:
            needs.append(graph.add(True, [self._object(schema, node) if t == "object" else self._array(schema, node)
                                          for t in types]))
        return needs

    def _object(self, schema: dict, node: int) -> int:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        needs = []
        for name in dict.fromkeys(n for n in required if isinstance(n, str)):
            if name in properties:
                needs.append(self.node(properties[name], node, f"properties/{_escape(name)}"))
            elif not schema.get("patternProperties") and "additionalProperties" in schema:
                needs.append(self.node(schema["additionalProperties"], node, "additionalProperties"))
        return self.graph.add(False, needs)

    def _array(self, schema: dict, node: int) -> int:
        least = schema.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        tuple_word = "prefixItems" if isinstance(schema.get("prefixItems"), list) else \
            "items" if isinstance(schema.get("items"), list) else None
        first = schema.get(tuple_word, []) if tuple_word else []
        rest_word = "items" if tuple_word != "items" else "additionalItems"
        needs = [self.node(part, node, f"{tuple_word}/{i}") for i, part in enumerate(first[:least])]
        if least > len(first) and rest_word in schema:
            needs.append(self.node(schema[rest_word], node, rest_word))
        if "contains" in schema and schema.get("minContains", 1) != 0:
            needs.append(self.node(schema["contains"], node, "contains"))
        return self.graph.add(False, needs)


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def endless_requirement(schema: Any) -> str | None:
    """None when some finite JSON value can match ``schema`` as far as its requirements go; else one
    line naming the cycle of subschemas that require each other without end."""
    if not isinstance(schema, dict):
        return None
    schemas = _Schemas(schema)
    root = schemas.build()
    productive = schemas.graph.productive()
    if productive[root]:
        return None
    path, seen, node = [], {}, root
    while node not in seen and node != schemas.false:
        if node in schemas.found:
            seen[node] = len(path)
            path.append(node)
        node = next(c for c in schemas.graph.children[node] if not productive[c])
    if node == schemas.false:
        return f"no JSON value matches it: {schemas.pointer(path[-1])!r} requires a value of a schema that is false"
    cycle = [schemas.pointer(n) for n in path[seen[node]:] + [node]]
    return (f"no finite JSON value matches it: {' -> '.join(repr(p) for p in cycle[:8])}"
            f"{' -> ...' if len(cycle) > 8 else ''} require each other without end; make one of them optional "
            "(not required, minItems 0, or an anyOf with a branch that does not recurse)")
