"""A Serve config's YAML read as written: a key given twice in one mapping is refused with its line. PyYAML, and so
`serve deploy`, keeps the last one without a word (an operator's second `num_replicas` silently replaced the first).
A value shaped like a date that is none is refused with its line too."""

from __future__ import annotations

import yaml

# `<<: *anchor` may repeat and merges rather than replaces; `=` is YAML's default-value key
NOT_KEYS = {"tag:yaml.org,2002:merge", "tag:yaml.org,2002:value"}


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping holding one key twice."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node):
        """Each mapping is checked once, as written: merging rewrites a merged mapping's keys in place, and a
        mapping that overrides a key it merged would read as a duplicate when an alias reaches it later."""
        if id(node) not in self._checked:
            self._checked.add(id(node))
            self._refuse_a_key_given_twice(node)
        super().flatten_mapping(node)

    def _refuse_a_key_given_twice(self, node) -> None:
        lines = {}  # each key's first line
        for key_node, _ in node.value:
            if key_node.tag in NOT_KEYS:
                continue
            key = self.construct_object(key_node, deep=True)  # any scalar: null and dates collide as well
            try:
                hash(key)
            except TypeError:  # a list or mapping as a key: PyYAML refuses it itself
                continue
            line = key_node.start_mark.line + 1
            if key in lines:  # one line, no YAML marks: the check prints one line per problem
                raise yaml.constructor.ConstructorError(
                    problem=f"key {key_node.value!r} given twice, on lines {lines[key]} and {line} (YAML would keep "
                    "the last one silently)"
                )
            lines[key] = line

    def construct_yaml_timestamp(self, node):
        """A value shaped like a date that is none (2026-13-45) is refused with its line, not Python's bare
        'month must be in 1..12'."""
        try:
            return super().construct_yaml_timestamp(node)
        except ValueError as err:
            problem = f"{node.value!r} on line {node.start_mark.line + 1} is no date: {err}"
            raise yaml.constructor.ConstructorError(problem=problem) from None


UniqueKeyLoader.add_constructor("tag:yaml.org,2002:timestamp", UniqueKeyLoader.construct_yaml_timestamp)


def read_yaml(text: str):
    """The document `text` holds, refusing duplicate keys (yaml.YAMLError, naming the key and its line)."""
    return yaml.load(text, Loader=UniqueKeyLoader)
