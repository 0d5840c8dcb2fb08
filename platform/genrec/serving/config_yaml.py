"""A Serve config's YAML read as written: a key given twice in one mapping is refused with its line. PyYAML, and so
`serve deploy`, keeps the last one without a word (an operator's second `num_replicas` silently replaced the first)."""

from __future__ import annotations

import yaml

MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *anchor` may repeat; it merges, it does not replace


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping holding one key twice."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines = {}  # each key's first line
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep) if key_node.tag != MERGE_TAG else None
                if isinstance(key, (str, int, float, bool)):
                    line = key_node.start_mark.line + 1
                    if key in lines:  # one line, no YAML marks: the check prints one line per problem
                        raise yaml.constructor.ConstructorError(
                            problem=f"key {key!r} given twice, on lines {lines[key]} and {line} (YAML would keep "
                            "the last one silently)"
                        )
                    lines[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str):
    """The document `text` holds, refusing duplicate keys (yaml.YAMLError, naming the key and its line)."""
    return yaml.load(text, Loader=UniqueKeyLoader)
