// te_fuser._storage_poison: the one file of te_fuser on torch's classic (unstable) C++ API.
//
// release_storage() frees a storage that views may still point at, leaving it a null data
// pointer. StorageImpl can be told to throw on every data-pointer access, reads included;
// that switch is not in the stable ABI, and only CUDA builds of torch bind it to Python
// (torch._C._set_storage_data_ptr_access_error_msg), hence this separate module for CPU
// builds. It writes StorageImpl's fields through torch's inline headers, so it is correct
// only under the exact torch it was built against: setup.py records that torch, and
// release_storage loads the module only under it.
#include <ATen/core/Tensor.h>
#include <Python.h>
#include <torch/library.h>

#include <string>

namespace {

void poison_storage(const at::Tensor& tensor, std::string message) {
  TORCH_CHECK(tensor.has_storage(), "poison_storage: tensor has no storage");
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  TORCH_CHECK(storage->_mutable_data_ptr_no_checks().get() == nullptr,
              "poison_storage: only a released storage (null data pointer) may be poisoned");
  storage->release_data_and_set_meta_custom_data_ptr_error_msg_(std::move(message));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def("poison_storage(Tensor(a!) tensor, str message) -> ()");
}

TORCH_LIBRARY_IMPL(te_fuser, CompositeExplicitAutograd, m) {
  m.impl("poison_storage", &poison_storage);
}

extern "C" PyMODINIT_FUNC PyInit__storage_poison(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_storage_poison",
                               "torch.ops.te_fuser.poison_storage (classic torch API)", -1,
                               nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
