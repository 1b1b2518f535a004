#include "blu/data/hf_tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "blu/core/error.h"

namespace blu {
namespace {

using json = nlohmann::json;

// Ids are dense enough in every real vocabulary; the bound keeps a corrupt id from sizing the
// id -> bytes table at gigabytes.
constexpr int64_t kMaxId = int64_t(1) << 24;
const std::string kIdRange = "an id in [0, 2^24)";

// A JSON value for an error message, cut short.
std::string shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 100) s = s.substr(0, 97) + "...";
  return s;
}

std::string json_quoted(std::string_view s) { return shown(json(std::string(s))); }

std::string utf8_of(char32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else {  // the byte alphabet ends at U+0143
    s += char(0xC0 | cp >> 6), s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

// Reads fields of one JSON file; every failure names the file, the field, what was expected and
// what was found.
struct Fields {
  std::string file;

  [[noreturn]] void fail(const std::string& field, const std::string& expected, const std::string& got) const {
    throw Error(file + ": " + field + ": expected " + expected + ", got " + got);
  }
  static const json* find(const json& obj, const char* key) {
    if (!obj.is_object()) return nullptr;
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
  }
  // obj[key] of the given kind; `field` is its dotted name for messages.
  const json& require(const json& obj, const char* key, const std::string& field, json::value_t kind,
                      const char* expected) const {
    const json* v = find(obj, key);
    if (!v) fail(field, expected, "nothing (the field is missing)");
    const bool ok = kind == json::value_t::number_integer ? v->is_number_integer() : v->type() == kind;
    if (!ok) fail(field, expected, shown(*v));
    return *v;
  }
  bool flag(const json& obj, const char* key, const std::string& field, bool fallback) const {
    const json* v = find(obj, key);
    if (!v || v->is_null()) return fallback;
    if (!v->is_boolean()) fail(field, "true or false", shown(*v));
    return v->get<bool>();
  }
  // A field that must be absent or null (a feature that is not supported).
  void require_null(const json& obj, const char* key, const std::string& field, const char* why) const {
    const json* v = find(obj, key);
    if (v && !v->is_null()) fail(field, std::string("null (") + why + ")", shown(*v));
  }
  std::string type_of(const json& obj, const std::string& field) const {
    return require(obj, "type", field + ".type", json::value_t::string, "a string naming the type").get<std::string>();
  }
};

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  BLU_CHECK(in.good(), "cannot open ", what, " ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json(std::string_view text, const std::string& name) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw Error(name + ": not valid JSON (" + e.what() + ")");
  }
}

// A token's raw bytes from its spelling, as the ByteLevel decoder turns it back: the bytes its
// alphabet code points stand for, or, for a spelling outside the alphabet, its own UTF-8.
std::string spelled_bytes(const std::string& spelling) {
  std::string bytes;
  return spelling_to_bytes(spelling, bytes) ? bytes : spelling;
}

}  // namespace

HfTokenizer::HfTokenizer() = default;
HfTokenizer::HfTokenizer(HfTokenizer&&) noexcept = default;
HfTokenizer& HfTokenizer::operator=(HfTokenizer&&) noexcept = default;
HfTokenizer::~HfTokenizer() = default;

void HfTokenizer::AddedSet::index() {
  for (auto& v : by_first_byte) v.clear();
  for (uint32_t i = 0; i < tokens.size(); ++i)
    by_first_byte[static_cast<unsigned char>(tokens[i].content[0])].push_back(i);
  for (auto& v : by_first_byte)
    std::stable_sort(v.begin(), v.end(),
                     [&](uint32_t a, uint32_t b) { return tokens[a].content.size() > tokens[b].content.size(); });
}

HfTokenizer HfTokenizer::load(const std::string& path) {
  HfTokenizer tok = from_json(read_file(path, "tokenizer file"), path);
  const auto config = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  if (!std::filesystem::exists(config)) return tok;
  const Fields f{config.string()};
  const json cfg = parse_json(read_file(config.string(), "tokenizer config file"), f.file);
  if (!cfg.is_object()) f.fail("(top level)", "a JSON object", shown(cfg));
  // "bos_token": "<s>" or {"content": "<s>", ...} (older files) or null.
  auto named = [&](const char* key) -> std::optional<std::string> {
    const json* v = Fields::find(cfg, key);
    if (!v || v->is_null()) return std::nullopt;
    if (v->is_string()) return v->get<std::string>();
    if (const json* c = Fields::find(*v, "content"); c && c->is_string()) return c->get<std::string>();
    f.fail(key, "a token's text, {\"content\": text} or null", shown(*v));
  };
  auto resolve = [&](const char* key, const std::string& content) {
    if (auto id = tok.special_token_id(content)) return *id;
    if (auto it = tok.vocab_by_bytes_.find(spelled_bytes(content)); it != tok.vocab_by_bytes_.end()) return it->second;
    f.fail(key, "a token of " + path, json_quoted(content) + ", which is neither an added token nor in model.vocab");
  };
  if (auto bos = named("bos_token")) tok.bos_ = resolve("bos_token", *bos);
  if (auto eos = named("eos_token")) tok.eos_ = resolve("eos_token", *eos);
  return tok;
}

HfTokenizer HfTokenizer::from_json(std::string_view json_text, const std::string& name) {
  const Fields f{name};
  const json root = parse_json(json_text, name);
  if (!root.is_object()) f.fail("(top level)", "a JSON object", shown(root));
  HfTokenizer tok;

  // --- what is not supported --------------------------------------------------------------------
  f.require_null(root, "normalizer", "normalizer", "normalizers are not supported");
  f.require_null(root, "truncation", "truncation", "encode must not cut text");
  f.require_null(root, "padding", "padding", "encode must not pad");

  // --- model ------------------------------------------------------------------------------------
  const json& model = f.require(root, "model", "model", json::value_t::object, "an object");
  if (const std::string type = f.type_of(model, "model"); type != "BPE") f.fail("model.type", "\"BPE\"", json_quoted(type));
  if (f.flag(model, "byte_fallback", "model.byte_fallback", false))
    f.fail("model.byte_fallback", "false (byte-level BPE has a token for every byte)", "true");
  f.require_null(model, "dropout", "model.dropout", "BPE dropout is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json* v = Fields::find(model, key);
    if (v && !v->is_null() && !(v->is_string() && v->get<std::string>().empty()))
      f.fail(std::string("model.") + key, "null or \"\" (not supported)", shown(*v));
  }
  tok.ignore_merges_ = f.flag(model, "ignore_merges", "model.ignore_merges", false);

  // vocab: {"<spelling>": id, ...}
  const json& vocab = f.require(model, "vocab", "model.vocab", json::value_t::object, "an object of token -> id");
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> id_of;  // spelling -> id
  int64_t max_id = -1;
  for (const auto& [spelling, value] : vocab.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() >= kMaxId)
      f.fail("model.vocab[" + json_quoted(spelling) + "]", kIdRange, shown(value));
    id_of.emplace(spelling, value.get<int32_t>());
    max_id = std::max<int64_t>(max_id, value.get<int64_t>());
  }
  if (id_of.empty()) f.fail("model.vocab", "a non-empty object", "{}");

  // added_tokens: [{"id", "content", "special", "normalized", "lstrip", "rstrip", "single_word"}, ...]
  const json* added = Fields::find(root, "added_tokens");
  if (added && !added->is_null() && !added->is_array()) f.fail("added_tokens", "an array", shown(*added));
  std::vector<std::pair<AddedToken, bool>> added_tokens;  // token, normalized
  if (added && added->is_array()) {
    for (size_t i = 0; i < added->size(); ++i) {
      const json& a = (*added)[i];
      const std::string field = "added_tokens[" + std::to_string(i) + "]";
      if (!a.is_object()) f.fail(field, "an object", shown(a));
      const json& id = f.require(a, "id", field + ".id", json::value_t::number_integer, "an integer id");
      if (id.get<int64_t>() < 0 || id.get<int64_t>() >= kMaxId) f.fail(field + ".id", kIdRange, shown(id));
      const std::string content =
          f.require(a, "content", field + ".content", json::value_t::string, "the token's text").get<std::string>();
      if (content.empty()) f.fail(field + ".content", "a non-empty text", "\"\"");
      if (f.flag(a, "single_word", field + ".single_word", false))
        f.fail(field + ".single_word", "false (single_word is not supported)", "true");
      const bool special = f.flag(a, "special", field + ".special", false);
      AddedToken t{content, id.get<int32_t>(), f.flag(a, "lstrip", field + ".lstrip", false),
                   f.flag(a, "rstrip", field + ".rstrip", false)};
      if (!tok.added_by_content_.emplace(content, t.id).second)
        f.fail(field + ".content", "a text no other added token has", json_quoted(content) + " a second time");
      max_id = std::max<int64_t>(max_id, t.id);
      added_tokens.emplace_back(std::move(t), f.flag(a, "normalized", field + ".normalized", !special));
    }
  }

  // Every id's bytes: vocabulary spellings through the byte alphabet, added tokens as written.
  tok.token_bytes_.assign(size_t(max_id) + 1, std::string());
  tok.assigned_.assign(size_t(max_id) + 1, 0);
  for (const auto& [spelling, id] : id_of) {
    if (tok.assigned_[id]) f.fail("model.vocab", "distinct ids", "id " + std::to_string(id) + " twice");
    tok.assigned_[id] = 1;
    std::string bytes;
    if (spelling_to_bytes(spelling, bytes)) {
      tok.vocab_by_bytes_.emplace(bytes, id);
      tok.token_bytes_[id] = std::move(bytes);
    } else {
      tok.token_bytes_[id] = spelling;  // unreachable by BPE; decodes to its own text
    }
  }
  for (auto& [t, normalized] : added_tokens) {
    tok.assigned_[t.id] = 1;
    tok.token_bytes_[t.id] = t.content;
    (normalized ? tok.normalized_added_ : tok.raw_added_).tokens.push_back(t);
  }
  tok.raw_added_.index();
  tok.normalized_added_.index();

  for (int b = 0; b < 256; ++b) {
    const std::string spelling = utf8_of(byte_to_code_point(static_cast<unsigned char>(b)));
    auto it = id_of.find(spelling);
    if (it == id_of.end()) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X", b);
      f.fail("model.vocab", "a token for every byte (byte-level BPE)",
             std::string("none for byte ") + hex + " (spelled " + json_quoted(spelling) + ")");
    }
    tok.bpe_.set_byte_token(static_cast<unsigned char>(b), it->second);
  }

  // merges: ["<left> <right>", ...] or [["<left>", "<right>"], ...], highest priority first.
  const json& merges = f.require(model, "merges", "model.merges", json::value_t::array, "an array of merges");
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& m = merges[i];
    const std::string field = "model.merges[" + std::to_string(i) + "]";
    std::string left, right;
    if (m.is_string()) {
      const std::string line = m.get<std::string>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == line.size() ||
          line.find(' ', space + 1) != std::string::npos)
        f.fail(field, "\"<left> <right>\"", shown(m));
      left = line.substr(0, space), right = line.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>(), right = m[1].get<std::string>();
    } else {
      f.fail(field, "\"<left> <right>\" or [\"<left>\", \"<right>\"]", shown(m));
    }
    for (const std::string* part : std::initializer_list<const std::string*>{&left, &right, nullptr}) {
      const std::string name = part ? *part : left + right;
      if (!id_of.contains(name))
        f.fail(field, "tokens of model.vocab",
               shown(m) + (part ? ", whose " + json_quoted(name) : ", whose result " + json_quoted(name)) +
                   " is not in model.vocab");
    }
    if (!tok.bpe_.add_merge(id_of.at(left), id_of.at(right), id_of.at(left + right)))
      f.fail(field, "each merge once", shown(m) + " again");
  }

  // --- pre_tokenizer: [Split | Digits]* then ByteLevel, or ByteLevel alone --------------------------
  const json& pre = f.require(root, "pre_tokenizer", "pre_tokenizer", json::value_t::object,
                              "a ByteLevel pre-tokenizer, or a Sequence ending in one");
  std::vector<std::pair<const json*, std::string>> steps;  // step, field name
  if (f.type_of(pre, "pre_tokenizer") == "Sequence") {
    const json& list = f.require(pre, "pretokenizers", "pre_tokenizer.pretokenizers", json::value_t::array,
                                 "an array of pre-tokenizers");
    for (size_t i = 0; i < list.size(); ++i)
      steps.emplace_back(&list[i], "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]");
  } else {
    steps.emplace_back(&pre, "pre_tokenizer");
  }
  if (steps.empty())
    f.fail("pre_tokenizer.pretokenizers", "a list ending in a ByteLevel pre-tokenizer", "an empty list");
  for (size_t i = 0; i < steps.size(); ++i) {
    const json& step = *steps[i].first;
    const std::string& field = steps[i].second;
    if (!step.is_object()) f.fail(field, "an object", shown(step));
    const std::string type = f.type_of(step, field);
    const bool last = i + 1 == steps.size();
    if (type == "ByteLevel") {
      if (!last) f.fail(field + ".type", "ByteLevel only as the last step", "ByteLevel before other steps");
      tok.byte_level_regex_ = f.flag(step, "use_regex", field + ".use_regex", true);
      tok.add_prefix_space_ = f.flag(step, "add_prefix_space", field + ".add_prefix_space", false);
      continue;
    }
    if (last) f.fail(field + ".type", "\"ByteLevel\" as the last step (byte-level BPE)", json_quoted(type));
    if (type == "Split") {
      const json& pattern = f.require(step, "pattern", field + ".pattern", json::value_t::object,
                                      "{\"Regex\": one of the supported regexes}");
      const json* regex = Fields::find(pattern, "Regex");
      if (!regex || !regex->is_string())
        f.fail(field + ".pattern", "{\"Regex\": one of the supported regexes}", shown(pattern));
      const auto known = split_pattern_from_regex(regex->get<std::string>());
      if (!known)
        f.fail(field + ".pattern.Regex", "the regex of GPT-2, Llama 3 or Qwen2 (see docs/tokenizer.md)",
               shown(*regex));
      const json* behavior = Fields::find(step, "behavior");
      if (!behavior || *behavior != "Isolated")
        f.fail(field + ".behavior", "\"Isolated\"", behavior ? shown(*behavior) : "nothing (the field is missing)");
      if (f.flag(step, "invert", field + ".invert", false)) f.fail(field + ".invert", "false", "true");
      tok.steps_.push_back(Step{Step::Kind::split, *known, false});
    } else if (type == "Digits") {
      tok.steps_.push_back(
          Step{Step::Kind::digits, SplitPattern::gpt2, f.flag(step, "individual_digits", field + ".individual_digits", false)});
    } else {
      f.fail(field + ".type", "\"Split\", \"Digits\" or \"ByteLevel\"", json_quoted(type));
    }
  }

  // --- decoder, post_processor ------------------------------------------------------------------------
  const json* decoder = Fields::find(root, "decoder");
  if (!decoder || !decoder->is_object() || !Fields::find(*decoder, "type") || (*decoder)["type"] != "ByteLevel")
    f.fail("decoder", "{\"type\": \"ByteLevel\", ...}",
           decoder ? shown(*decoder) : "nothing (the field is missing)");
  // The post-processor adds nothing to encode() (it runs with add_special_tokens=false); a
  // TemplateProcessing that starts with a special token tells which token begins a text.
  std::vector<const json*> processors;
  if (const json* post = Fields::find(root, "post_processor"); post && post->is_object()) {
    processors.push_back(post);
    if (const json* list = Fields::find(*post, "processors"); list && list->is_array())
      for (const json& p : *list) processors.push_back(&p);
  }
  for (const json* p : processors) {
    if (!Fields::find(*p, "type") || (*p)["type"] != "TemplateProcessing") continue;
    const json* single = Fields::find(*p, "single");
    if (!single || !single->is_array() || single->empty()) continue;
    const json* first = Fields::find((*single)[0], "SpecialToken");
    const json* name = first ? Fields::find(*first, "id") : nullptr;
    if (name && name->is_string())
      if (auto id = tok.special_token_id(name->get<std::string>())) tok.bos_ = *id;
  }
  return tok;
}

std::optional<int32_t> HfTokenizer::special_token_id(std::string_view content) const {
  auto it = added_by_content_.find(content);
  return it == added_by_content_.end() ? std::nullopt : std::optional<int32_t>(it->second);
}

void HfTokenizer::set_bos(std::string_view content) {
  auto id = special_token_id(content);
  BLU_CHECK(id, "set_bos: expected an added token's text, got ", json_quoted(content), ", which is no added token");
  bos_ = *id;
}

void HfTokenizer::set_eos(std::string_view content) {
  auto id = special_token_id(content);
  BLU_CHECK(id, "set_eos: expected an added token's text, got ", json_quoted(content), ", which is no added token");
  eos_ = *id;
}

// Leftmost-longest, as the Rust library's Aho-Corasick (MatchKind::LeftmostLongest) finds them.
// lstrip/rstrip widen a match over the Unicode whitespace before/after it, which then belongs to
// the token and is not encoded.
template <typename OnText, typename OnToken>
void HfTokenizer::split_added(std::string_view text, const AddedSet& set, OnText&& on_text, OnToken&& on_token) {
  if (set.tokens.empty()) {
    on_text(text);
    return;
  }
  size_t done = 0;  // text[0, done) has been handed out
  for (size_t pos = 0; pos < text.size();) {
    const AddedToken* hit = nullptr;
    for (uint32_t k : set.by_first_byte[static_cast<unsigned char>(text[pos])]) {
      const AddedToken& t = set.tokens[k];
      if (text.substr(pos, t.content.size()) == t.content) {
        hit = &t;
        break;  // longest first
      }
    }
    if (!hit) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + hit->content.size();
    if (hit->lstrip) start = std::max(done, trailing_whitespace_start(text.substr(0, start)));
    if (hit->rstrip) stop += leading_whitespace(text.substr(stop));
    if (start > done) on_text(text.substr(done, start - done));
    on_token(hit->id);
    done = pos = stop;
  }
  if (done < text.size()) on_text(text.substr(done));
}

template <typename OnPiece>
void HfTokenizer::for_each_piece(std::string_view text, OnPiece&& on_piece) const {
  std::vector<std::string_view> pieces{text}, next;
  for (const Step& step : steps_) {
    next.clear();
    for (std::string_view p : pieces) {
      if (step.kind == Step::Kind::split) regex_pretokenize(p, step.pattern, Whitespace::unicode, next);
      else split_digits(p, step.individual_digits, next);
    }
    pieces.swap(next);
  }
  // ByteLevel: an optional leading space, then GPT-2's pattern (with Unicode \s, as Oniguruma's).
  std::string spaced;
  for (std::string_view p : pieces) {
    if (add_prefix_space_ && !p.starts_with(' ')) {
      spaced.assign(" ").append(p);
      p = spaced;
    }
    if (!byte_level_regex_) {
      on_piece(p);
      continue;
    }
    next.clear();
    regex_pretokenize(p, SplitPattern::gpt2, Whitespace::unicode, next);
    for (std::string_view q : next) on_piece(q);
  }
}

void HfTokenizer::encode_stretch(std::string_view text, std::vector<int32_t>& out) const {
  for_each_piece(text, [&](std::string_view piece) {
    if (ignore_merges_)
      if (auto it = vocab_by_bytes_.find(piece); it != vocab_by_bytes_.end()) {
        out.push_back(it->second);
        return;
      }
    bpe_.encode_piece(piece, out);
  });
}

template <typename OnText, typename OnToken>
void HfTokenizer::for_each_stretch(std::string_view text, OnText&& on_text, OnToken&& on_token) const {
  split_added(
      text, raw_added_,
      [&](std::string_view stretch) { split_added(stretch, normalized_added_, on_text, on_token); }, on_token);
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  for_each_stretch(
      text, [&](std::string_view stretch) { encode_stretch(stretch, out); }, [&](int32_t id) { out.push_back(id); });
  return out;
}

std::vector<std::string> HfTokenizer::pretokenize(std::string_view text) const {
  std::vector<std::string> out;
  for_each_stretch(
      text,
      [&](std::string_view stretch) {
        for_each_piece(stretch, [&](std::string_view piece) { out.emplace_back(piece); });
      },
      [](int32_t) {});
  return out;
}

std::string HfTokenizer::decode_token(int32_t id) const {
  BLU_CHECK(id >= 0 && id < vocab_size() && assigned_[id], "token id ", id,
            " is not a token of this tokenizer: ids are in [0, ", vocab_size(), ")",
            id >= 0 && id < vocab_size() ? " and this one is assigned to no token" : "");
  return token_bytes_[id];
}

std::string HfTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    BLU_CHECK(id >= 0 && id < vocab_size() && assigned_[id], "token id ", id, " at position ", i,
              " is not a token of this tokenizer: ids are in [0, ", vocab_size(), ")",
              id >= 0 && id < vocab_size() ? " and this one is assigned to no token" : "");
    text += token_bytes_[id];
  }
  return text;
}

}  // namespace blu
