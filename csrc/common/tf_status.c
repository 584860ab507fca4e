#include "tf_status.h"

const char *tf_status_string(tf_status status) {
  switch (status) {
    case TF_OK: return "ok";
    case TF_ERR_NULL_POINTER: return "a required pointer is NULL";
    case TF_ERR_BAD_SIZE: return "a size is negative or inconsistent";
    case TF_ERR_OVERFLOW: return "an index computation would overflow int64";
    case TF_ERR_BAD_DTYPE: return "unsupported dtype";
    case TF_ERR_BAD_ARGUMENT: return "an argument is outside its domain";
    case TF_ERR_CUDA: return "a CUDA launch failed";
  }
  return "unknown status";
}
