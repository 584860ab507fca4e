// The CPU tier dispatch of csrc/common/cpu_features.h, reachable from Python
// (te_fuser.kernels.cpu). These ops take no tensor, so they are registered for
// CompositeExplicitAutograd, which the dispatcher uses when no tensor picks a backend.
#include "binding_util.h"

extern "C" {
#include "../common/cpu_features.h"
}

namespace te_fuser {
namespace {

int64_t cpu_isa_detected() { return static_cast<int64_t>(tf_cpu_isa_detected()); }

int64_t cpu_isa_current() { return static_cast<int64_t>(tf_cpu_isa()); }

int64_t cpu_isa_cap() { return tf_cpu_isa_cap(); }

// Sets the cap (-1: none) and returns the previous one.
int64_t cpu_isa_set_cap(int64_t cap) {
  STD_TORCH_CHECK(cap >= -1 && cap < TF_ISA_COUNT, "cap must lie in [-1, ", TF_ISA_COUNT - 1,
                  "], got ", cap);
  const int previous = tf_cpu_isa_cap();
  check_status(tf_set_cpu_isa_cap(static_cast<int>(cap)), "cpu_isa_set_cap");
  return previous;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def("cpu_isa_detected() -> int");
  m.def("cpu_isa_current() -> int");
  m.def("cpu_isa_cap() -> int");
  m.def("cpu_isa_set_cap(int cap) -> int");
}

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa_detected", TORCH_BOX(&te_fuser::cpu_isa_detected));
  m.impl("cpu_isa_current", TORCH_BOX(&te_fuser::cpu_isa_current));
  m.impl("cpu_isa_cap", TORCH_BOX(&te_fuser::cpu_isa_cap));
  m.impl("cpu_isa_set_cap", TORCH_BOX(&te_fuser::cpu_isa_set_cap));
}
