#include "server/backends/rope_frequencies.h"

#include <algorithm>
#include <cmath>

namespace mha {
namespace {

constexpr double kPi = 3.14159265358979323846;

// theta^(-2i / dim) for i < dim / 2: the unscaled frequencies of base `theta`.
std::vector<double> Plain(double theta, int64_t dim) {
  std::vector<double> inv_freq(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    inv_freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
  }
  return inv_freq;
}

RopeFrequencies Yarn(const HeadSpec& h) {
  const RopeScaling& r = h.rope_scaling;
  const double dim = static_cast<double>(h.rope_dim), base = h.rope_theta, factor = r.Factor();
  RopeFrequencies out;
  out.attention_factor = r.attention_factor != 0 ? r.attention_factor
                         : r.mscale != 0 && r.mscale_all_dim != 0
                             ? YarnMscale(factor, r.mscale) / YarnMscale(factor, r.mscale_all_dim)
                             : YarnMscale(factor, 1.0);
  // The dims whose wavelength turns beta_fast / beta_slow times over the original context bound the ramp from
  // extrapolation (the plain frequency) to interpolation (divided by factor).
  const double original = static_cast<double>(r.original_max_position_embeddings);
  const auto correction_dim = [&](double rotations) {
    return dim * std::log(original / (rotations * 2 * kPi)) / (2 * std::log(base));
  };
  double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;  // as transformers: no singular ramp
  out.inv_freq = Plain(base, h.rope_dim);
  for (size_t i = 0; i < out.inv_freq.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1.0 - ramp;
    out.inv_freq[i] = out.inv_freq[i] / factor * (1.0 - extrapolation) + out.inv_freq[i] * extrapolation;
  }
  return out;
}

RopeFrequencies Longrope(const HeadSpec& h, int64_t seq_len) {
  const RopeScaling& r = h.rope_scaling;
  const double factor = r.Factor(), original = static_cast<double>(r.original_max_position_embeddings);
  RopeFrequencies out;
  out.attention_factor = r.attention_factor != 0 ? r.attention_factor
                         : factor <= 1.0         ? 1.0
                                                 : std::sqrt(1.0 + std::log(factor) / std::log(original));
  const std::vector<double>& divisors = seq_len > r.original_max_position_embeddings ? r.long_factor : r.short_factor;
  out.inv_freq = Plain(h.rope_theta, h.rope_dim);
  for (size_t i = 0; i < out.inv_freq.size(); ++i) out.inv_freq[i] /= divisors[i];
  return out;
}

RopeFrequencies Llama3(const HeadSpec& h) {
  const RopeScaling& r = h.rope_scaling;
  const double original = static_cast<double>(r.original_max_position_embeddings);
  const double low_wavelength = original / r.low_freq_factor, high_wavelength = original / r.high_freq_factor;
  RopeFrequencies out;
  out.inv_freq = Plain(h.rope_theta, h.rope_dim);
  for (double& f : out.inv_freq) {
    const double wavelength = 2 * kPi / f;
    if (wavelength > low_wavelength) {
      f /= r.factor;
    } else if (!(wavelength < high_wavelength)) {  // between the two: smoothed
      const double smooth = (original / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      f = (1 - smooth) * f / r.factor + smooth * f;
    }
  }
  return out;
}

}  // namespace

RopeFrequencies ComputeRopeFrequencies(const HeadSpec& h, int64_t seq_len) {
  const RopeScaling& r = h.rope_scaling;
  switch (r.type) {
    case RopeScaling::Type::kLinear: {
      RopeFrequencies out{Plain(h.rope_theta, h.rope_dim), 1.0};
      for (double& f : out.inv_freq) f /= r.factor;
      return out;
    }
    case RopeScaling::Type::kDynamic: {
      // NTK-aware: the base grows with the sequence once it passes max_position_embeddings.
      const double dim = static_cast<double>(h.rope_dim), max = static_cast<double>(r.max_position_embeddings);
      const double length = std::max(static_cast<double>(seq_len), max);
      const double base = h.rope_theta * std::pow(r.factor * length / max - (r.factor - 1), dim / (dim - 2));
      return {Plain(base, h.rope_dim), 1.0};
    }
    case RopeScaling::Type::kYarn: return Yarn(h);
    case RopeScaling::Type::kLongrope: return Longrope(h, seq_len);
    case RopeScaling::Type::kLlama3: return Llama3(h);
    case RopeScaling::Type::kDefault: break;
  }
  return {Plain(h.rope_theta, h.rope_dim), 1.0};
}

}  // namespace mha
