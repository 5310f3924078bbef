#include "client/npy.h"

#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/mha/v1/tensor_codec.h"

namespace mha {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
// numpy aligns the start of the data to this many bytes (numpy.lib.format.ARRAY_ALIGN).
constexpr size_t kArrayAlign = 64;
// numpy leaves room for the first axis to grow to this many digits (numpy.lib.format.GROWTH_AXIS_MAX_DIGITS).
constexpr size_t kGrowthAxisMaxDigits = 21;

absl::Status Bad(absl::string_view origin, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(origin, ": ", what));
}

const char* Descr(v1::DataType dtype) { return dtype == v1::FP16 ? "<f2" : "<f4"; }

// The parsed header dict. Only the three keys numpy writes are accepted, as numpy itself requires.
struct Header {
  bool has_descr = false, has_fortran_order = false, has_shape = false;
  std::string descr;
  bool structured = false;  // descr was a list (a structured dtype)
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

// A recursive-descent reader of the Python literal numpy writes; each method returns an error detail or "".
class HeaderParser {
 public:
  explicit HeaderParser(absl::string_view text) : text_(text) {}

  std::string Parse(Header* header) {
    SkipSpace();
    if (!Consume('{')) return Expected("'{'");
    while (true) {
      SkipSpace();
      if (Consume('}')) break;
      std::string key;
      if (std::string error = String(&key); !error.empty()) return error;
      SkipSpace();
      if (!Consume(':')) return Expected("':'");
      SkipSpace();
      if (key == "descr") {
        header->has_descr = true;
        if (Peek() == '[') {
          header->structured = true;
          if (std::string error = SkipList(); !error.empty()) return error;
        } else if (std::string error = String(&header->descr); !error.empty()) {
          return error;
        }
      } else if (key == "fortran_order") {
        header->has_fortran_order = true;
        if (ConsumeWord("True")) {
          header->fortran_order = true;
        } else if (ConsumeWord("False")) {
          header->fortran_order = false;
        } else {
          return Expected("True or False");
        }
      } else if (key == "shape") {
        header->has_shape = true;
        if (std::string error = Shape(&header->shape); !error.empty()) return error;
      } else {
        return absl::StrCat("unexpected key '", key, "'");
      }
      SkipSpace();
      if (Consume(',')) continue;
      if (Consume('}')) break;
      return Expected("',' or '}'");
    }
    SkipSpace();
    if (pos_ != text_.size()) return absl::StrCat("unexpected text after the dict at offset ", pos_);
    return "";
  }

 private:
  char Peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  bool Consume(char c) {
    if (Peek() != c) return false;
    ++pos_;
    return true;
  }
  bool ConsumeWord(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }
  void SkipSpace() {
    while (pos_ < text_.size() && absl::ascii_isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  std::string Expected(absl::string_view what) const {
    return absl::StrCat("expected ", what, " at offset ", pos_);
  }

  // A quoted string without escapes ('...' or "...").
  std::string String(std::string* out) {
    const char quote = Peek();
    if (quote != '\'' && quote != '"') return Expected("a quoted string");
    const size_t end = text_.find(quote, pos_ + 1);
    if (end == absl::string_view::npos) return absl::StrCat("unterminated string at offset ", pos_);
    *out = std::string(text_.substr(pos_ + 1, end - pos_ - 1));
    if (out->find('\\') != std::string::npos) return absl::StrCat("escaped string at offset ", pos_);
    pos_ = end + 1;
    return "";
  }

  // A bracketed list (of a structured descr), skipped with its nesting.
  std::string SkipList() {
    int depth = 0;
    for (; pos_ < text_.size(); ++pos_) {
      const char c = text_[pos_];
      if (c == '[' || c == '(') ++depth;
      if ((c == ']' || c == ')') && --depth == 0) {
        ++pos_;
        return "";
      }
    }
    return "unterminated list";
  }

  // "()", "(5,)", "(2, 3)": non-negative integers, an optional trailing comma (and Python 2's 'L' suffix).
  std::string Shape(std::vector<int64_t>* shape) {
    if (!Consume('(')) return Expected("'(' starting the shape tuple");
    while (true) {
      SkipSpace();
      if (Consume(')')) return "";
      if (!absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) return Expected("a non-negative integer");
      int64_t dim = 0;
      while (absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) {
        if (dim > (std::numeric_limits<int64_t>::max() - 9) / 10) return "shape entry overflows int64";
        dim = dim * 10 + (text_[pos_++] - '0');
      }
      Consume('L');
      shape->push_back(dim);
      SkipSpace();
      if (Consume(',')) continue;
      if (Consume(')')) {
        // numpy writes a 1-tuple as "(5,)"; "(5)" is an int in Python, not a tuple.
        if (shape->size() == 1) return "a one-element shape must be written (n,)";
        return "";
      }
      return Expected("',' or ')' in the shape tuple");
    }
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

// numpy's header dict text before padding.
std::string HeaderDict(const NpyArray& array) {
  const std::string shape = NpyShapeString(array.shape);
  std::string dict = absl::StrCat("{'descr': '", Descr(array.dtype), "', 'fortran_order': False, 'shape': ", shape,
                                  ", }");
  if (!array.shape.empty()) {
    const size_t digits = absl::StrCat(array.shape[0]).size();
    if (digits < kGrowthAxisMaxDigits) dict.append(kGrowthAxisMaxDigits - digits, ' ');
  }
  return dict;
}

}  // namespace

int64_t NpyArray::NumElements() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

std::string NpyShapeString(const std::vector<int64_t>& shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

absl::StatusOr<NpyArray> ParseNpy(absl::string_view bytes, absl::string_view origin) {
  if (bytes.size() < kMagicLen || bytes.substr(0, kMagicLen) != absl::string_view(kMagic, kMagicLen)) {
    return Bad(origin, "not a .npy file (no \\x93NUMPY magic string)");
  }
  if (bytes.size() < kMagicLen + 2) return Bad(origin, "truncated before the format version");
  const int major = static_cast<unsigned char>(bytes[6]), minor = static_cast<unsigned char>(bytes[7]);
  if ((major != 1 && major != 2 && major != 3) || minor != 0) {
    return Bad(origin, absl::StrCat("unsupported .npy format version ", major, ".", minor,
                                    "; expected 1.0, 2.0 or 3.0"));
  }
  const size_t length_bytes = major == 1 ? 2 : 4;
  const size_t preamble = kMagicLen + 2 + length_bytes;
  if (bytes.size() < preamble) return Bad(origin, "truncated before the header length");
  uint64_t header_len = 0;
  for (size_t i = 0; i < length_bytes; ++i) {
    header_len |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[kMagicLen + 2 + i])) << (8 * i);
  }
  if (header_len > bytes.size() - preamble) {
    return Bad(origin, absl::StrCat("truncated header: needs ", header_len, " bytes after the ", preamble,
                                    "-byte preamble, file has ", bytes.size() - preamble));
  }
  const absl::string_view text = bytes.substr(preamble, header_len);

  Header header;
  if (std::string error = HeaderParser(text).Parse(&header); !error.empty()) {
    return Bad(origin, absl::StrCat("malformed header: ", error));
  }
  for (const auto& [present, key] : {std::pair<bool, const char*>{header.has_descr, "descr"},
                                     {header.has_fortran_order, "fortran_order"},
                                     {header.has_shape, "shape"}}) {
    if (!present) return Bad(origin, absl::StrCat("malformed header: no '", key, "' key"));
  }
  NpyArray array;
  if (header.structured) {
    return Bad(origin, "structured dtypes are not supported; expected '<f4' (float32) or '<f2' (float16)");
  }
  if (header.descr == "<f4") {
    array.dtype = v1::FP32;
  } else if (header.descr == "<f2") {
    array.dtype = v1::FP16;
  } else {
    return Bad(origin, absl::StrCat("dtype '", header.descr,
                                    "' is not supported; expected '<f4' (float32) or '<f2' (float16)"));
  }
  if (header.fortran_order) {
    return Bad(origin, "Fortran-order arrays are not supported; save a C-order array (numpy.ascontiguousarray)");
  }
  array.shape = header.shape;

  const uint64_t element_size = DTypeSize(array.dtype);
  uint64_t need = element_size;
  for (int64_t dim : array.shape) {
    if (dim != 0 && need > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(dim)) {
      return Bad(origin, absl::StrCat("shape ", NpyShapeString(array.shape), " is too large"));
    }
    need *= static_cast<uint64_t>(dim);
  }
  const absl::string_view data = bytes.substr(preamble + header_len);
  if (data.size() != need) {
    return Bad(origin, absl::StrCat(data.size() < need ? "truncated data: " : "trailing bytes: ", "shape ",
                                    NpyShapeString(array.shape), " of '", header.descr, "' needs ", need,
                                    " data bytes, file has ", data.size()));
  }
  array.data = std::string(data);
  return array;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream contents;
  contents << file.rdbuf();
  return ParseNpy(contents.str(), path);
}

std::string SerializeNpy(const NpyArray& array) {
  const std::string dict = HeaderDict(array);
  // The header ends with '\n' and is padded with spaces so that the data starts at a multiple of kArrayAlign; as
  // in numpy, an already aligned header still gets a full kArrayAlign of padding.
  auto padded_length = [&](size_t length_bytes) {
    const size_t unpadded = kMagicLen + 2 + length_bytes + dict.size() + 1;
    return dict.size() + 1 + (kArrayAlign - unpadded % kArrayAlign);
  };
  size_t length_bytes = 2;
  size_t header_len = padded_length(2);
  if (header_len > 0xFFFF) {
    length_bytes = 4;
    header_len = padded_length(4);
  }
  std::string out(kMagic, kMagicLen);
  out.push_back(static_cast<char>(length_bytes == 2 ? 1 : 2));
  out.push_back(0);
  for (size_t i = 0; i < length_bytes; ++i) out.push_back(static_cast<char>((header_len >> (8 * i)) & 0xFF));
  out += dict;
  out.append(header_len - dict.size() - 1, ' ');
  out.push_back('\n');
  out += array.data;
  return out;
}

absl::Status WriteNpy(const std::string& path, const NpyArray& array) {
  const std::string bytes = SerializeNpy(array);
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return absl::InternalError(absl::StrCat("cannot create ", path));
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  file.close();
  if (!file) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

NpyArray NpyFromTensor(const v1::Tensor& tensor) {
  NpyArray array;
  array.shape.assign(tensor.shape().begin(), tensor.shape().end());
  if (tensor.dtype() == v1::FP16 || tensor.dtype() == v1::FP32) {
    array.dtype = tensor.dtype();
    array.data = tensor.data();
    return array;
  }
  const std::vector<float> values = TensorToFloats(tensor);
  array.dtype = v1::FP32;
  array.data.assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return array;
}

absl::Status NpyToTensor(const NpyArray& array, int rank, absl::string_view field, absl::string_view layout,
                         v1::Tensor* tensor) {
  bool ok = static_cast<int>(array.shape.size()) == rank;
  for (int64_t dim : array.shape) ok = ok && dim >= 1;
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", NpyShapeString(array.shape), " must be ",
                                                   layout, " with every dim >= 1"));
  }
  tensor->Clear();
  for (int64_t dim : array.shape) tensor->add_shape(dim);
  tensor->set_dtype(array.dtype);
  tensor->set_data(array.data);
  return absl::OkStatus();
}

}  // namespace mha
