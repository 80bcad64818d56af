// See ../../rendezvous/context.h: a declaration is all Paddle's header needs.
#pragma once
namespace gloo { namespace transport { class Device; } }
