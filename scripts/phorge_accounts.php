<?php

/**
 * Accounts in a Phorge, made through Phorge's own classes, for the tests and the
 * bench that run PHP inside a checkout (after scripts/init/init-script.php):
 * find or make a user, find or make its Conduit API token.
 */

function phorge_bridge_account(
  PhabricatorUser $viewer,
  $name,
  $admin = false,
  $agent = false) {

  $user = id(new PhabricatorPeopleQuery())
    ->setViewer($viewer)
    ->withUsernames(array($name))
    ->executeOne();
  if ($user) {
    return $user;
  }
  $user = id(new PhabricatorUser())
    ->setUsername($name)
    ->setRealName($name)
    ->setIsApproved(1)
    ->setIsAdmin($admin ? 1 : 0)
    ->setIsSystemAgent($agent ? 1 : 0);
  $email = id(new PhabricatorUserEmail())
    ->setAddress($name.'@example.com')
    ->setIsVerified(1);
  id(new PhabricatorUserEditor())
    ->setActor($viewer)
    ->createNewUser($user, $email);
  return $user;
}

function phorge_bridge_api_token(PhabricatorUser $viewer, PhabricatorUser $user) {
  $token = id(new PhabricatorConduitTokenQuery())
    ->setViewer($viewer)
    ->withObjectPHIDs(array($user->getPHID()))
    ->withTokenTypes(array(PhabricatorConduitToken::TYPE_STANDARD))
    ->withExpired(false)
    ->setLimit(1)
    ->executeOne();
  if (!$token) {
    $token = PhabricatorConduitToken::initializeNewToken(
      $user->getPHID(),
      PhabricatorConduitToken::TYPE_STANDARD);
    $token->save();
  }
  return $token->getToken();
}
