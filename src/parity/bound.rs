//! Bounds a JSON schema for greedy generation by a tiny model, which can repeat one token inside
//! a string, a number or an open object forever. Every bound only narrows: an output valid under
//! the bounded schema is valid under the original, so the original still judges it.

use serde_json::{json, Map, Value};

/// How far the bounds go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bounds {
    /// Strings at most 12 characters (48 with a format, 80 with a pattern, which may demand 64
    /// hex digits), arrays at most 2 items (they nest), numbers as integers within +-10^6,
    /// objects closed to their declared and required keys, and unconstrained subschemas as
    /// short scalars.
    Strict,
    /// As `Strict`, but patterned strings keep their own length and numbers with a `multipleOf`
    /// their own range: llguidance cannot always decide whether a pattern intersected with a
    /// length, or a multiple intersected with a range, is empty.
    Lenient,
}

/// `schema` with bounds added, or tightened, where generation could run on.
pub fn bounded_for_generation(schema: &Value, bounds: Bounds) -> Value {
    let mut schema = schema.clone();
    bound(&mut schema, bounds, false);
    schema
}

/// Keywords whose value is one subschema (or, for `items`, possibly an array of them).
const SUBSCHEMA: [&str; 9] = [
    "items",
    "additionalItems",
    "additionalProperties",
    "contains",
    "propertyNames",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
];
/// Keywords whose value maps names to subschemas.
const SUBSCHEMA_MAP: [&str; 5] = [
    "properties",
    "patternProperties",
    "definitions",
    "$defs",
    "dependentSchemas",
];
/// Keywords whose value is an array of subschemas.
const SUBSCHEMA_LIST: [&str; 4] = ["allOf", "anyOf", "oneOf", "prefixItems"];
/// Keywords whose subschemas are branches: each one describes the same instance as its parent
/// and its siblings, so it is bounded and typed but never closed or replaced on its own.
const BRANCHES: [&str; 3] = ["allOf", "anyOf", "oneOf"];
/// Keywords that constrain an instance (or hold subschemas a `$ref` may point into); a schema
/// with none of them accepts anything. (`not` and `if` are never descended into: narrowing them
/// would widen the schema around them.)
const CONSTRAINING: [&str; 41] = [
    "type",
    "enum",
    "const",
    "$ref",
    "$dynamicRef",
    "$recursiveRef",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "properties",
    "patternProperties",
    "additionalProperties",
    "propertyNames",
    "required",
    "minProperties",
    "maxProperties",
    "dependencies",
    "dependentSchemas",
    "dependentRequired",
    "unevaluatedProperties",
    "items",
    "prefixItems",
    "additionalItems",
    "contains",
    "minItems",
    "maxItems",
    "uniqueItems",
    "unevaluatedItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "definitions",
    "$defs",
];

/// Whether `map`, as a schema, accepts anything.
fn unconstrained(map: &Map<String, Value>) -> bool {
    !map.keys().any(|k| CONSTRAINING.contains(&k.as_str()))
}

/// Any short scalar: what an unconstrained subschema generates.
fn short_scalar() -> Value {
    json!({
        "type": ["string", "integer", "boolean", "null"],
        "maxLength": 12,
        "minimum": -1_000_000,
        "maximum": 1_000_000,
    })
}

fn bound(v: &mut Value, bounds: Bounds, branch: bool) {
    let map = match v {
        Value::Bool(true) if !branch => return *v = short_scalar(),
        Value::Object(map) => map,
        _ => return,
    };
    if unconstrained(map) && !branch {
        return *v = short_scalar();
    }
    if !has(
        map,
        &["type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf"],
    ) {
        infer_type(map);
    }
    let types: Vec<String> = match map.get("type") {
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    };
    let is = |t: &str| types.iter().any(|x| x == t);
    let fixed = has(map, &["enum", "const"]);
    if is("string") && !fixed {
        bound_string(map, bounds);
    }
    if is("array") && !has(map, &["prefixItems"]) {
        let min = map.get("minItems").and_then(Value::as_u64).unwrap_or(0);
        cap(map, "maxItems", min.max(2));
        map.entry("items").or_insert_with(short_scalar);
    }
    if is("number") && !is("integer") && !fixed {
        integers_only(map);
    }
    let own_range = bounds == Bounds::Lenient && map.contains_key("multipleOf");
    if (is("integer") || is("number")) && !fixed && !own_range {
        if !has(map, &["maximum", "exclusiveMaximum"]) {
            map.insert("maximum".into(), Value::from(1_000_000));
        }
        if !has(map, &["minimum", "exclusiveMinimum"]) {
            map.insert("minimum".into(), Value::from(-1_000_000));
        }
    }
    if (is("object") || map.contains_key("properties")) && !fixed && !branch {
        close_object(map);
    }
    for (key, child) in map.iter_mut() {
        let key = key.as_str();
        if SUBSCHEMA.contains(&key) {
            match child {
                Value::Array(items) => items.iter_mut().for_each(|c| bound(c, bounds, false)),
                _ => bound(child, bounds, false),
            }
        } else if SUBSCHEMA_MAP.contains(&key) {
            if let Value::Object(named) = child {
                named.values_mut().for_each(|c| bound(c, bounds, false));
            }
        } else if SUBSCHEMA_LIST.contains(&key) {
            if let Value::Array(items) = child {
                let branch = BRANCHES.contains(&key);
                items.iter_mut().for_each(|c| bound(c, bounds, branch));
            }
        }
    }
}

/// Keywords that apply to one instance type only, by type.
const TYPE_KEYWORDS: [(&str, &[&str]); 4] = [
    (
        "object",
        &[
            "properties",
            "additionalProperties",
            "required",
            "patternProperties",
        ],
    ),
    ("array", &["items", "prefixItems", "minItems", "maxItems"]),
    ("string", &["minLength", "maxLength", "pattern", "format"]),
    (
        "number",
        &["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"],
    ),
];

/// Gives an untyped schema the types its keywords apply to: without a type, `properties`
/// describes objects but lets every number, string and array through.
fn infer_type(map: &mut Map<String, Value>) {
    let types: Vec<Value> = TYPE_KEYWORDS
        .iter()
        .filter(|(_, keys)| has(map, keys))
        .map(|(t, _)| Value::from(*t))
        .collect();
    let ty = match types.len() {
        0 => return,
        1 => types[0].clone(),
        _ => Value::Array(types),
    };
    map.insert("type".into(), ty);
}

fn has(map: &Map<String, Value>, keys: &[&str]) -> bool {
    keys.iter().any(|k| map.contains_key(*k))
}

/// Sets `key` to `limit`, or keeps a smaller limit the schema already has.
fn cap(map: &mut Map<String, Value>, key: &str, limit: u64) {
    let limit = map
        .get(key)
        .and_then(Value::as_u64)
        .map_or(limit, |own| own.min(limit));
    map.insert(key.into(), Value::from(limit));
}

fn bound_string(map: &mut Map<String, Value>, bounds: Bounds) {
    let pattern = map.contains_key("pattern");
    if pattern && bounds == Bounds::Lenient {
        return;
    }
    // Patterns and formats need room for their fixed parts; a long email fails its format.
    let room = match (pattern, map.contains_key("format")) {
        (true, _) => 80,
        (false, true) => 48,
        (false, false) => 12,
    };
    let min = map.get("minLength").and_then(Value::as_u64).unwrap_or(0);
    cap(map, "maxLength", min.max(room));
}

/// Narrows `number` to `integer`: a fraction is where a tiny model repeats a digit forever.
fn integers_only(map: &mut Map<String, Value>) {
    let Some(t) = map.get_mut("type") else { return };
    *t = match t.take() {
        Value::String(_) => Value::from("integer"),
        Value::Array(ts) => ts
            .into_iter()
            .map(|x| {
                if x == "number" {
                    Value::from("integer")
                } else {
                    x
                }
            })
            .collect(),
        other => other,
    };
}

/// Keywords through which an object gets keys declared elsewhere: closing it to its own
/// `properties` could make it unsatisfiable.
const COMPOSED: [&str; 8] = [
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "if",
    "dependencies",
    "dependentSchemas",
    "unevaluatedProperties",
];

/// Closes an object whose other keys are unconstrained: its keys become the declared and the
/// required ones. A key's value keeps every constraint it had, its own schema and those of the
/// `patternProperties` it matches, or becomes a short scalar when nothing constrains it.
fn close_object(map: &mut Map<String, Value>) {
    if has(map, &COMPOSED) {
        return;
    }
    let open = match map.get("additionalProperties") {
        None | Some(Value::Bool(true)) => true,
        Some(Value::Object(o)) => unconstrained(o),
        Some(_) => false,
    };
    let patterns = match map.get("patternProperties") {
        None => Map::new(),
        Some(Value::Object(p)) => p.clone(),
        Some(_) => return,
    };
    let required: Vec<String> = map
        .get("required")
        .and_then(Value::as_array)
        .map(|r| {
            r.iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    if !open {
        let closed = map.get("additionalProperties") == Some(&Value::Bool(false));
        if !(closed && patterns.is_empty()) {
            cap_properties(map, &required);
        }
        return;
    }
    let Value::Object(properties) = map
        .entry("properties")
        .or_insert_with(|| Value::Object(Map::new()))
    else {
        return;
    };
    for name in required {
        properties.entry(name).or_insert(Value::Bool(true));
    }
    for (name, schema) in properties.iter_mut() {
        let own = Some(schema.take()).filter(|s| *s != Value::Bool(true));
        let matching = patterns
            .iter()
            .filter(|(pattern, _)| pattern_matches(pattern, name))
            .map(|(_, s)| s.clone());
        let all: Vec<Value> = own.into_iter().chain(matching).collect();
        *schema = match <[Value; 1]>::try_from(all) {
            Ok([only]) => only,
            Err(all) if all.is_empty() => Value::Bool(true),
            Err(all) => json!({ "allOf": all }),
        };
    }
    map.remove("patternProperties");
    map.insert("additionalProperties".into(), Value::Bool(false));
}

/// Caps how many keys an object whose other keys are constrained may take: one beyond the
/// required ones. llguidance counts keys only when every declared key is required.
fn cap_properties(map: &mut Map<String, Value>, required: &[String]) {
    let all_required = map
        .get("properties")
        .and_then(Value::as_object)
        .is_none_or(|p| p.keys().all(|k| required.contains(k)));
    if all_required {
        let min = map
            .get("minProperties")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        cap(map, "maxProperties", min.max(required.len() as u64 + 1));
    }
}

/// Whether `name` matches a `patternProperties` pattern, as the judging validator reads it; a
/// pattern it cannot read counts as matching, which can only add constraints.
fn pattern_matches(pattern: &str, name: &str) -> bool {
    jsonschema::validator_for(&json!({ "pattern": pattern }))
        .map_or(true, |v| v.is_valid(&json!(name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strict(schema: Value) -> Value {
        bounded_for_generation(&schema, Bounds::Strict)
    }

    #[test]
    fn string_limits_are_capped_not_widened() {
        let out = strict(json!({"type": "string", "maxLength": 1000}));
        assert_eq!(out["maxLength"], 12);
        let out = strict(json!({"type": "string", "maxLength": 5}));
        assert_eq!(out["maxLength"], 5);
        let out = strict(json!({"type": "string", "minLength": 20}));
        assert_eq!(out["maxLength"], 20);
    }

    #[test]
    fn patterned_strings_keep_their_length_when_asked() {
        let schema = json!({"type": "string", "pattern": "^[a-f0-9]{64}$"});
        let out = bounded_for_generation(&schema, Bounds::Lenient);
        assert_eq!(out, schema);
        assert_eq!(strict(schema)["maxLength"], 80);
    }

    #[test]
    fn open_objects_close_over_declared_and_required_keys() {
        let out = strict(json!({
            "type": "object",
            "properties": {"_id": {"type": "integer"}},
            "required": ["id"],
        }));
        assert_eq!(out["additionalProperties"], false);
        assert_eq!(out["properties"]["id"], short_scalar());
        assert_eq!(out["properties"]["_id"]["maximum"], 1_000_000);
        let composed = json!({"type": "object", "anyOf": [{"$ref": "#/$defs/a"}]});
        assert_eq!(strict(composed.clone()), composed);
        let out = strict(json!({"type": "object", "additionalProperties": {"type": "string"}}));
        assert_eq!(out["additionalProperties"]["maxLength"], 12);
    }

    #[test]
    fn pattern_properties_apply_to_the_keys_kept() {
        let out = strict(json!({
            "type": "object",
            "patternProperties": {"^V": {"type": "integer"}, "^x": {"type": "null"}},
            "properties": {"Vb": {"minimum": 0}},
            "required": ["Va"],
        }));
        assert_eq!(out.get("patternProperties"), None);
        assert_eq!(out["additionalProperties"], false);
        assert_eq!(out["properties"]["Va"]["type"], "integer");
        assert_eq!(out["properties"]["Vb"]["allOf"][1]["maximum"], 1_000_000);
    }

    #[test]
    fn constrained_extra_keys_are_counted() {
        let out = strict(json!({
            "type": "object",
            "patternProperties": {"^[a-z]{2}$": {"type": "string"}},
            "additionalProperties": false,
            "minProperties": 1,
        }));
        assert_eq!(out["maxProperties"], 1);
        assert_eq!(out["patternProperties"]["^[a-z]{2}$"]["maxLength"], 12);
        let optional = json!({
            "type": "object",
            "properties": {"a": {"type": "null"}},
            "additionalProperties": {"type": "null"},
        });
        assert_eq!(strict(optional.clone()), optional);
    }

    #[test]
    fn unconstrained_subschemas_become_short_scalars() {
        let out = strict(json!({"type": "array", "items": {"x-vendor-note": "anything"}}));
        assert_eq!(out["items"], short_scalar());
        assert_eq!(out["maxItems"], 2);
        let out = strict(json!({"type": "array", "items": true}));
        assert_eq!(out["items"], short_scalar());
        let out = strict(json!({"type": "array"}));
        assert_eq!(out["items"], short_scalar());
    }

    #[test]
    fn multiples_get_a_range_unless_lenient() {
        let schema = json!({"type": "number", "multipleOf": 0.01});
        assert_eq!(strict(schema.clone())["maximum"], 1_000_000);
        let out = bounded_for_generation(&schema, Bounds::Lenient);
        assert_eq!(out, json!({"type": "integer", "multipleOf": 0.01}));
    }

    #[test]
    fn untyped_schemas_take_the_type_of_their_keywords() {
        let out = strict(json!({"properties": {"a": {"type": "string"}}}));
        assert_eq!(out["type"], "object");
        assert_eq!(out["additionalProperties"], false);
        let out = strict(json!({"minimum": 0, "pattern": "^a"}));
        assert_eq!(out["type"], json!(["string", "integer"]));
        let composed = strict(json!({"anyOf": [{"type": "string"}], "minimum": 0}));
        assert_eq!(composed.get("type"), None);
        let branches = json!({"properties": {"a": {}}, "anyOf": [{"required": ["a"]}, true]});
        let typed = json!([{"type": "object", "required": ["a"]}, true]);
        assert_eq!(strict(branches)["anyOf"], typed);
    }

    #[test]
    fn data_and_negations_are_left_alone() {
        let schema = json!({
            "enum": [{"type": "string"}],
            "default": {"type": "number"},
            "not": {"type": "string"},
        });
        assert_eq!(strict(schema.clone()), schema);
    }

    #[test]
    fn properties_named_like_keywords_are_properties() {
        let out = strict(json!({
            "type": "object",
            "properties": {"type": {"type": "string"}, "maxLength": {"type": "number"}},
        }));
        assert_eq!(out["properties"]["type"]["maxLength"], 12);
        assert_eq!(out["properties"]["maxLength"]["type"], "integer");
    }
}
